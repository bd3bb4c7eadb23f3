"""DPP's command lines: the cost model fitted to this machine.

    calibrate.py  `python -m megatron_ext.dpp.tools.calibrate`: time real megatron layers and
                  the output layer, fit the cost model, then (unless --no-overhead) overhead.py
    overhead.py   what a real PP=2 step spends beyond the layers timed alone (two processes)
"""
