"""serve's garbage-collector tuning: start-up objects frozen, young threshold raised; 0
leaves Python's settings alone."""

import gc

from rollout_gateway.commands.serve import tune_gc
from rollout_gateway.settings import GatewaySettings


def test_tune_gc_freezes_start_up_and_raises_the_young_threshold():
    before = gc.get_threshold()
    try:
        tune_gc(0)
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        tune_gc(GatewaySettings().gc_young_threshold)
        assert gc.get_threshold() == (50_000, *before[1:])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
