"""The LoRA sweep planner: which jobs share a pack, on how many devices with which TP/DP degree,
in what order, within memory. Pure: it reads jobs and models, never trains.

    plan.py       Pack, Plan: what the planner produces and the runtime executes
    workload.py   the shapes a job touches and the passes it needs
    memory.py     a pack's memory on one device (feasibility)
    costmodel.py  a packed pass's time on tp x dp devices (linear fit or GPU roofline)
    problem.py    a sweep as the planners see it, with pack timings and memory checks remembered
    simulate.py   a plan run under the cost model: job start and end times, makespan, peak memory
    planner.py    the PLoRA planner (packing, shapes, order)
    exact.py      exact plans for small sweeps (CP-SAT, else brute force)
    pass_size.py  `lora.max_pass_tokens: auto`: the tokens one packed pass should hold
    report.py     a plan as a text table and a Gantt chart
"""
