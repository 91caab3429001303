import pytest

from rollout_gateway.errors import InvalidArgument
from rollout_gateway.store.factory import store_from_url
from rollout_gateway.store.memory import MemoryStore
from rollout_gateway.store.redis_streams import RedisStore


def test_memory_urls(tmp_path):
    s = store_from_url("memory://?max_backlog=7&lease_seconds=2.5")
    assert isinstance(s, MemoryStore) and s.config.max_backlog == 7
    assert s.config.lease_seconds == 2.5 and s._db is None
    j = store_from_url(f"memory://?journal={tmp_path / 'j.db'}")
    assert j._db is not None and (tmp_path / "j.db").exists()
    k = store_from_url(f"memory://{tmp_path / 'k.db'}")  # memory:///abs/path
    assert k._db is not None and (tmp_path / "k.db").exists()


def test_redis_url_keeps_connection_params_and_prefix():
    s = store_from_url("redis://127.0.0.1:6379/3?prefix=jobA&max_deliveries=9")
    assert isinstance(s, RedisStore)
    assert s.prefix == "jobA" and s.config.max_deliveries == 9
    assert s._k_stream == "jobA:stream"
    assert s._r.connection_pool.connection_kwargs["db"] == 3


@pytest.mark.parametrize("url", ["kafka://x", "memory://relative.db", "memory://?max_backlog=0",
                                 "memory://?lease_seconds=abc", "memory://?bogus=1"])
def test_bad_urls_are_invalid_argument(url):
    with pytest.raises(InvalidArgument):
        store_from_url(url)
