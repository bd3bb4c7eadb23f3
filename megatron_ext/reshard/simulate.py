"""The stall of a reshard, and of the checkpoint route, on a described cluster: a model.

    traffic = traffic_from_rounds(rounds(plan, budget))   # or a per-rank plan's own rounds
    s = stall(traffic, H100_CLASS, world=plan.world)
    print(s.agree, s.switch, s.transfer, s.total)
    c = checkpoint_route(held_bytes(layout_pieces(m, a)), held_bytes(layout_pieces(m, b)),
                         state_bytes(layout_pieces(m, a)), H100_CLASS)

The core takes plain data (rounds of (src, dst, bytes, copies) transfers; a rank's held bytes),
so any planner that can say what each round moves can feed it. Nothing here needs torch.

The model, exactly (seconds; a rank is on node rank // gpus_per_node):

Transfer. For each round and each rank r, over each link class c (intra: both ends on one
node, NVSwitch / shared memory; inter: different nodes, the fat tree):
    net_c(r)  = latency_c · messages_c(r) + wire_c(r)
    wire_c(r) = max(sent_c(r), received_c(r)) / bandwidth_c    (duplex link: sending and
                                                                receiving overlap)
              = (sent_c(r) + received_c(r)) / bandwidth_c      (not duplex: the rank's own
                                                                core packs, then unpacks)
    work(r)   = copy_overhead · copies(r) + max_c net_c(r) + local(r) / copy_bandwidth
messages_c(r) counts the distinct peers r sends to plus those it receives from over c;
copies(r) the packs, unpacks and local copies it issues; local(r) the bytes it copies locally.
The link classes are separate engines (NVLink and the NIC), so the longer of the two counts.
A round ends when its slowest rank finishes; on a node whose ranks share `cores_per_node`
processors (a CPU host: every copy is a core's work) also no sooner than the node's total
work spread over them, and on a node whose ranks share one memory (`node_copy_bandwidth`: a
CPU host, where sends and receives are copies through shared memory too) no sooner than the
bytes its ranks copy, all together, at that rate:
    round     = round_collectives · collective + shared(work)
    shared(w) = max(max_r w(r), max_node Σ_{r on node} w(r) / cores,
                    max_node Σ_{r on node} copied(r) / node_copy_bandwidth)
copied(r) = sent(r) + received(r) + local(r), over both link classes; the second term counts
only where `cores_per_node` is set, the third only where `node_copy_bandwidth` is.
A phased transport (shared memory: every rank packs, a barrier, every rank unpacks) has two
such maxima per round, one over the send phase's work (packs, local copies, sends) and one
over the receive phase's (unpacks, receives), each with only its own messages, copies and
copied bytes.
    transfer  = setup_s + arena / setup_bandwidth + shared(touch) + Σ rounds + collective
    touch(r)  = (max_k sent_k(r) + Σ_p max_k received_k(p → r)) / touch_bandwidth
where arena is the largest bytes a rank sends in one round (what the shared-memory transport
reserves per move; no setup when nothing crosses the network), and the final collective is the
ranks' success report (live.py `_gather_errors`: one all-reduce when nothing failed). touch(r)
is the first touch of staging memory the move has not used before: each round a rank packs into
its own arena from its start (so it touches its largest round's sends once) and reads what each
peer p left for it in p's arena (counted as p's largest message to it: a pair's rounds are alike,
each as full as the pair's capacity allows, but the last); fresh shared-memory pages are mapped
on first access, a core's work (shared() without the copied bytes); none where `touch_bandwidth`
is infinite (staging mapped when allocated, or reused).

Topology: inter-node traffic crosses a full-bisection fat tree, so a rank's inter-node sends
and receives are limited only by its own NIC, whatever the pattern (no congestion, no
adaptive-routing loss); intra-node traffic crosses a non-blocking NVSwitch, limited only by
the GPU's own NVLink bandwidth. Links carry no other traffic during the stall.

A small collective (all-gather of a digest, all-reduce of a flag) over `world` ranks takes
    collective = collective_step_s · ceil(log2(world))     (recursive doubling / tree)

The stall has the live reports' parts (live.py):
    agree     = 3 · collective + shared(cut)        (execute.py `schedule`: an all-reduce of
                                                     every rank's plan digest and byte counts,
                                                     then each rank cuts its own rounds, then
                                                     an all-reduce of the round counts and
                                                     staging; live.py `_agree`: an all-reduce
                                                     of the build failures)
    switch    = switch_s + collective               (install the layout built ahead, then
                                                     the ranks' success report)
              + build(B) when it is built at the switch instead
cut(r) is rank r's own work between the first two collectives (execute.py `traffic`,
`rank_rounds`, `peak_bytes` on its plan: Python, growing with its ops), an input measured by
timing those pure functions (0 where not given); shared() is the round's rule above without
the copied bytes (the work is a core's, not the memory's).
    transfer  as above
    build(B)  = build_fixed_s + max_r held_B(r) / build_bandwidth

The checkpoint route (save in A, build B, load in B):
    save   = save_fixed_s + max(max_r held_A(r) / serialize_bandwidth,
                                state / min(nodes · write_per_node, write_aggregate))
    load   = load_fixed_s + max(max_r held_B(r) / serialize_bandwidth,
                                Σ_r held_B(r) / min(nodes · read_per_node, read_aggregate))
    route  = save + build(B) + load
A rank works through everything it holds (replicas included); the storage sees the state
written once and read by every rank that holds a part of it; nodes are those holding state.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Iterable, Mapping, Optional


@dataclasses.dataclass(frozen=True)
class Transfer:
    """`nbytes` from rank `src` to rank `dst` in `copies` ops (a local copy when they are equal)."""

    src: int
    dst: int
    nbytes: int
    copies: int = 1

    @property
    def local(self) -> bool:
        return self.src == self.dst


Round = tuple[Transfer, ...]


@dataclasses.dataclass(frozen=True)
class Link:
    """One class of link as one rank sees it."""

    bandwidth: float  # bytes/s in each direction
    latency_s: float  # per message (one peer, one round)
    duplex: bool = True  # sends and receives overlap; False: one after the other


@dataclasses.dataclass(frozen=True)
class Storage:
    """Where the checkpoint route's files go, and the per-rank cost of (de)serialising."""

    write_per_node: float  # bytes/s
    read_per_node: float
    serialize_bandwidth: float  # bytes/s one rank saves or loads of what it holds
    save_fixed_s: float
    load_fixed_s: float
    write_aggregate: float = math.inf  # the file system's cap, all nodes together
    read_aggregate: float = math.inf


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    intra: Link
    inter: Link
    copy_bandwidth: float  # bytes/s of a rank's local copies (device memory)
    copy_overhead_s: float  # per copy a rank issues (a kernel launch, a torch call)
    collective_step_s: float  # one step of a small collective
    switch_s: float  # installing a layout built ahead
    build_fixed_s: float  # building a layout at the switch: fixed part
    build_bandwidth: float  # ... and per byte of state a rank holds in it
    storage: Storage
    round_collectives: int = 0  # barriers the transport needs per round
    setup_s: float = 0.0  # the transport's setup per move
    setup_bandwidth: float = math.inf  # arena bytes per second reserved at setup
    touch_bandwidth: float = math.inf  # staging bytes/s a rank touches first (page faults); inf: none
    cores_per_node: Optional[float] = None  # copy engines a node's ranks share; None: each its own
    node_copy_bandwidth: Optional[float] = None  # bytes/s a node's ranks copy together; None: no cap
    phased: bool = False  # a barrier between a round's sends and its receives (shared memory)
    topology: str = "full-bisection fat tree between nodes, non-blocking NVSwitch within a node"
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class Stall:
    agree: float
    switch: float
    transfer: float

    @property
    def total(self) -> float:
        return self.agree + self.switch + self.transfer


@dataclasses.dataclass(frozen=True)
class CheckpointRoute:
    save: float
    build: float
    load: float

    @property
    def total(self) -> float:
        return self.save + self.build + self.load


def collective_seconds(cluster: Cluster, world: int) -> float:
    return cluster.collective_step_s * math.ceil(math.log2(max(world, 2)))


# The small collectives each part of a live move runs when nothing fails (module docstring).
AGREE_COLLECTIVES = 3
SWITCH_COLLECTIVES = 1
TRANSFER_COLLECTIVES = 1


# The parts of a round a rank's work is counted for: all of it, or (a phased transport) the
# send phase (packs and local copies) and the receive phase (unpacks).
ALL, SEND, RECEIVE = "all", "send", "receive"


@dataclasses.dataclass
class _RankRound:
    """One rank's share of one round, per link class."""

    sent: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    received: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    to: dict = dataclasses.field(default_factory=lambda: defaultdict(set))  # class -> peers
    heard: dict = dataclasses.field(default_factory=lambda: defaultdict(set))
    packs: int = 0
    unpacks: int = 0
    local_copies: int = 0
    local: int = 0


def _shares(transfers: Round, cluster: Cluster) -> dict[int, _RankRound]:
    shares: dict[int, _RankRound] = defaultdict(_RankRound)
    for t in transfers:
        if t.local:
            shares[t.src].local += t.nbytes
            shares[t.src].local_copies += t.copies
            continue
        link = "intra" if cluster.node(t.src) == cluster.node(t.dst) else "inter"
        out, into = shares[t.src], shares[t.dst]
        out.sent[link] += t.nbytes
        out.to[link].add(t.dst)
        out.packs += t.copies
        into.received[link] += t.nbytes
        into.heard[link].add(t.src)
        into.unpacks += t.copies
    return shares


def _work(share: _RankRound, cluster: Cluster, part: str) -> float:
    """Seconds of `part` of a rank's round (module docstring: work(r), or a phase of it)."""
    copies = {ALL: share.packs + share.unpacks + share.local_copies,
              SEND: share.packs + share.local_copies, RECEIVE: share.unpacks}[part]
    network = max(_network(share, getattr(cluster, name), name, part) for name in ("intra", "inter"))
    local = 0.0 if part == RECEIVE else share.local / cluster.copy_bandwidth
    return cluster.copy_overhead_s * copies + network + local


def _network(share: _RankRound, link: Link, name: str, part: str) -> float:
    out, into = share.sent.get(name, 0), share.received.get(name, 0)
    peers_out, peers_in = len(share.to.get(name, ())), len(share.heard.get(name, ()))
    if part == SEND:
        return link.latency_s * peers_out + out / link.bandwidth
    if part == RECEIVE:
        return link.latency_s * peers_in + into / link.bandwidth
    wire = max(out, into) if link.duplex else out + into
    return link.latency_s * (peers_out + peers_in) + wire / link.bandwidth


def rank_work(transfers: Round, cluster: Cluster, part: str = ALL) -> dict[int, float]:
    """Each rank's seconds of work in one round, or in one phase of it."""
    return {rank: _work(share, cluster, part) for rank, share in _shares(transfers, cluster).items()}


def _copied(share: _RankRound, part: str) -> int:
    """Bytes `part` of a rank's round copies: its packs (sends) and local copies, its unpacks."""
    sent, received = sum(share.sent.values()), sum(share.received.values())
    return {ALL: sent + received + share.local, SEND: sent + share.local, RECEIVE: received}[part]


def shared_seconds(work: Mapping[int, float], cluster: Cluster, copied: Optional[Mapping[int, int]] = None) -> float:
    """Until the slowest rank is done; on shared cores also the busiest node's work spread over
    them, and on a shared memory the most bytes a node's ranks copy at the node's rate (the
    module docstring's shared())."""
    longest = max(work.values(), default=0.0)
    if cluster.cores_per_node:
        longest = max(longest, max(_per_node(work, cluster).values(), default=0.0) / cluster.cores_per_node)
    if cluster.node_copy_bandwidth and copied:
        longest = max(longest, max(_per_node(copied, cluster).values(), default=0) / cluster.node_copy_bandwidth)
    return longest


def _per_node(values: Mapping[int, float], cluster: Cluster) -> dict[int, float]:
    per_node: dict[int, float] = defaultdict(float)
    for rank, value in values.items():
        per_node[cluster.node(rank)] += value
    return per_node


def round_seconds(transfers: Round, cluster: Cluster, world: int) -> float:
    """One round: its barriers, then until its slowest rank (or busiest shared node) is done;
    with a phased transport, the send phase's and then the receive phase's."""
    parts = (SEND, RECEIVE) if cluster.phased else (ALL,)
    shares = _shares(transfers, cluster)
    work = sum(
        shared_seconds({r: _work(s, cluster, part) for r, s in shares.items()}, cluster,
                       {r: _copied(s, part) for r, s in shares.items()})
        for part in parts
    )
    return cluster.round_collectives * collective_seconds(cluster, world) + work


def transfer_seconds(traffic: list[Round], cluster: Cluster, world: int) -> float:
    arena = max((_most_sent(r) for r in traffic), default=0)
    setup = cluster.setup_s + arena / cluster.setup_bandwidth if arena else 0.0
    touch = shared_seconds({r: n / cluster.touch_bandwidth for r, n in touched_bytes(traffic).items()}, cluster)
    rounds_s = sum(round_seconds(r, cluster, world) for r in traffic)
    return setup + touch + rounds_s + TRANSFER_COLLECTIVES * collective_seconds(cluster, world)


def touched_bytes(traffic: list[Round]) -> dict[int, int]:
    """Each rank's staging bytes touched first in a move (the module docstring's touch(r) less
    the bandwidth): its largest round of sends, and per sender the largest message it read."""
    own: dict[int, int] = defaultdict(int)
    heard: dict[tuple[int, int], int] = defaultdict(int)  # (sender, receiver) -> largest message
    for transfers in traffic:
        sent: dict[int, int] = defaultdict(int)
        pair: dict[tuple[int, int], int] = defaultdict(int)
        for t in transfers:
            if not t.local:
                sent[t.src] += t.nbytes
                pair[t.src, t.dst] += t.nbytes
        for rank, n in sent.items():
            own[rank] = max(own[rank], n)
        for key, n in pair.items():
            heard[key] = max(heard[key], n)
    out = dict(own)
    for (_, dst), n in heard.items():
        out[dst] = out.get(dst, 0) + n
    return out


def _most_sent(transfers: Round) -> int:
    sent: dict[int, int] = defaultdict(int)
    for t in transfers:
        if not t.local:
            sent[t.src] += t.nbytes
    return max(sent.values(), default=0)


def build_seconds(held_b: Mapping[int, int], cluster: Cluster) -> float:
    return cluster.build_fixed_s + max(held_b.values(), default=0) / cluster.build_bandwidth


def agree_seconds(cluster: Cluster, world: int, cut: Optional[Mapping[int, float]] = None) -> float:
    """The agreement: its collectives and the ranks' own round cutting (`cut`: seconds per
    rank, measured; module docstring)."""
    return AGREE_COLLECTIVES * collective_seconds(cluster, world) + shared_seconds(cut or {}, cluster)


def stall(
    traffic: list[Round],
    cluster: Cluster,
    world: int,
    held_b: Optional[Mapping[int, int]] = None,
    built_ahead: bool = True,
    cut: Optional[Mapping[int, float]] = None,
) -> Stall:
    """The live move's stall; `held_b` (bytes each rank holds in B) is needed when the new
    layout is built at the switch (`built_ahead=False`); `cut`: each rank's seconds of cutting
    its rounds in the agreement (timed; none: not counted)."""
    switch = cluster.switch_s + SWITCH_COLLECTIVES * collective_seconds(cluster, world)
    if not built_ahead:
        if held_b is None:
            raise ValueError("simulate: a layout built at the switch needs held_b")
        switch += build_seconds(held_b, cluster)
    return Stall(agree_seconds(cluster, world, cut), switch, transfer_seconds(traffic, cluster, world))


def checkpoint_route(
    held_a: Mapping[int, int], held_b: Mapping[int, int], state: int, cluster: Cluster
) -> CheckpointRoute:
    """Save in A, build B, load in B (module docstring); `state` is the bytes of the whole
    training state, each element once."""
    s = cluster.storage
    nodes_a = _nodes(held_a, cluster)
    nodes_b = _nodes(held_b, cluster)
    write = min(nodes_a * s.write_per_node, s.write_aggregate)
    read = min(nodes_b * s.read_per_node, s.read_aggregate)
    save = s.save_fixed_s + max(max(held_a.values(), default=0) / s.serialize_bandwidth, state / write)
    load = s.load_fixed_s + max(
        max(held_b.values(), default=0) / s.serialize_bandwidth, sum(held_b.values()) / read
    )
    return CheckpointRoute(save, build_seconds(held_b, cluster), load)


def _nodes(held: Mapping[int, int], cluster: Cluster) -> int:
    return len({cluster.node(r) for r, n in held.items() if n}) or 1


# --- adapters: today's planner and executor ---------------------------------------------------


def traffic_from_rounds(steps: Iterable) -> list[Round]:
    """execute.rounds(plan, budget) as plain transfers, one per (src, dst) pair and round with
    the pair's bytes and op count (duck-typed: anything with .ops of .src/.dst/.nbytes)."""
    out = []
    for step in steps:
        pairs: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
        for op in step.ops:
            pair = pairs[op.src, op.dst]
            pair[0] += op.nbytes
            pair[1] += 1
        out.append(tuple(Transfer(s, d, n, c) for (s, d), (n, c) in pairs.items()))
    return out


def held_bytes(pieces: Iterable) -> dict[int, int]:
    """Bytes each rank holds, from a layout's pieces (vps.layout_pieces)."""
    out: dict[int, int] = defaultdict(int)
    for piece in pieces:
        out[piece.rank] += piece.nbytes
    return dict(out)


def state_bytes(pieces: Iterable) -> int:
    """Bytes of the whole training state, each element once, from a layout's pieces."""
    tensors = {}
    for p in pieces:
        tensors[p.name, p.state] = math.prod(p.shape) * p.nbytes // math.prod(b - a for a, b in p.box)
    return sum(tensors.values())


# --- a named cluster ----------------------------------------------------------------------------

GB = 1e9

# H100/H800-class: 8 GPUs a node on NVSwitch, one 400 Gb/s InfiniBand NIC per GPU, a
# full-bisection fat tree. Each number's source is in `sources`; "assumption" marks a value
# that is not a vendor figure or a measurement.
H100_CLASS = Cluster(
    name="h100-class",
    gpus_per_node=8,
    intra=Link(bandwidth=450 * GB, latency_s=5e-6),
    inter=Link(bandwidth=50 * GB, latency_s=10e-6),
    copy_bandwidth=3.35e12 / 2,
    copy_overhead_s=5e-6,
    collective_step_s=10e-6,
    switch_s=0.03,
    build_fixed_s=10.0,
    build_bandwidth=100 * GB,
    storage=Storage(
        write_per_node=20 * GB,
        read_per_node=40 * GB,
        serialize_bandwidth=25 * GB,
        save_fixed_s=1.0,
        load_fixed_s=2.0,
    ),
    sources={
        "intra": "NVLink 4 through NVSwitch: 900 GB/s per GPU both directions together (NVIDIA "
        "H100 SXM datasheet), so 450 GB/s each way; latency 5 us per message: assumption (NCCL "
        "point-to-point over NVLink, small messages)",
        "inter": "400 Gb/s InfiniBand NDR per GPU = 50 GB/s each way (ConnectX-7); latency 10 us "
        "per message: assumption (NCCL point-to-point over IB, small messages)",
        "copy_bandwidth": "HBM3 3.35 TB/s (H100 SXM datasheet); a device copy reads and writes "
        "each byte, so half of it: an upper bound, achieved copies reach ~80-90%",
        "copy_overhead_s": "5 us per copy kernel launched: assumption",
        "collective_step_s": "10 us per step of a small NCCL collective: assumption; it prices every "
        "collective of a move (on this repository's CPU host the step is measured as a move's agreement "
        "runs it, about twice a quiet loop's there, where 4 ranks share 2 cores; a GPU rank has host "
        "cores of its own)",
        "touch_bandwidth": "none (infinite): staging in device memory is mapped when allocated "
        "(cudaMalloc, then reused by the caching allocator; NCCL's buffers are set up once), so no "
        "page is faulted in during a move",
        "node_copy_bandwidth": "none: each GPU copies in its own HBM (a shared memory bus is this "
        "repository's CPU host's only)",
        "agree": "3 small collectives; the ranks' round cutting is priced where the caller times it "
        "(`stall(cut=...)`), else not counted",
        "switch_s": "installing a layout built ahead is host-side Python: measured on this "
        "repository's CPU benchmark (0.02-0.06 s); assumed the same on a GPU host",
        "build": "building a layout at the switch (new NCCL communicators at scale, model, DDP, "
        "optimizer): 10 s fixed + 100 GB/s of state per GPU: assumption",
        "storage": "a parallel file system giving each node 20 GB/s write and 40 GB/s read, no "
        "aggregate cap; a GPU serialises its state to host memory at 25 GB/s (PCIe 5 x16 is 64 "
        "GB/s raw); save / load fixed parts 1 s / 2 s: assumptions",
    },
)


def describe(cluster: Cluster) -> dict:
    """The cluster as JSON-ready data."""
    return jsonable(dataclasses.asdict(cluster))


def jsonable(value):
    """`value` with infinities and NaN as None (JSON has neither), through dicts and lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
