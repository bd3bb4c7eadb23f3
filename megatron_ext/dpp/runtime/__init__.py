"""DPP's runtime: a StepPlan run on megatron-core's p2p layer, identical on every rank.

    attention.py  core attention over a chunk: packed sequences and slices of split ones
    batch.py      global batches of whole documents, and a chunk's model inputs
    blend.py      a megatron data blend read as one source of whole documents
    loop.py       the schedule loop: each stage's ops of a plan on megatron's p2p layer
    memory.py     what a stage holds for backward, counted exactly, and when each op ran
    ahead.py      the next global batch planned in a background thread
"""
