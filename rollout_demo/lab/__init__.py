"""The staleness lab: named experiments (presets) with paired statistics over seeds.

``registry`` (presets), ``stats`` (paired CIs, verdicts), ``report`` (docs/lab.md),
``grid`` (the first lab's methods x lags grid, ``--grid``); ``python -m rollout_demo.lab``.
"""
