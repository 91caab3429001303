"""``serve --workers N``: refused (a clear message, exit 2) without a shared store and
registry; the workers' SO_REUSEPORT sockets share a port. The process test is
tests/integration/test_gateway_workers.py."""

from __future__ import annotations

import argparse

import pytest

from rollout_gateway.commands import serve
from rollout_gateway.commands.workers import reuseport_socket
from rollout_gateway.errors import InvalidArgument
from rollout_gateway.settings import load_settings


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("store,registry,bad", [
    ("memory://", "redis://127.0.0.1:6379/0", "store_url=memory://"),
    ("redis://127.0.0.1:6379/0", "memory://", "registry_url=memory://"),
    ("memory:///tmp/j.db", "memory://", "store_url=memory:///tmp/j.db and registry_url"),
])
def test_several_workers_need_a_shared_store_and_registry(store, registry, bad):
    with pytest.raises(InvalidArgument) as e:
        load_settings(None, workers=2, store_url=store, registry_url=registry)
    assert bad in e.value.message and "--workers 1" in e.value.message


def test_serve_refuses_workers_on_the_embedded_store(capsys):
    assert serve.run(_args("--workers", "3", "--store", "memory://")) == 2
    out = capsys.readouterr().out
    assert "workers=3 needs a store and a registry the workers share" in out


def test_workers_setting_is_read_from_the_flag_and_bounded():
    s = serve.settings_from_args(_args("--workers", "4", "--store", "redis://h:1/0",
                                       "--registry", "rediss://h:1/0"))
    assert s.workers == 4
    assert load_settings(None).workers == 1
    with pytest.raises(InvalidArgument):
        load_settings(None, workers=0)


def test_reuseport_sockets_share_a_port():
    held = reuseport_socket("127.0.0.1", 0, listen=False)
    port = held.getsockname()[1]
    a = reuseport_socket("127.0.0.1", port, listen=True)
    b = reuseport_socket("127.0.0.1", port, listen=True)
    try:
        assert a.getsockname()[1] == b.getsockname()[1] == port
    finally:
        for s in (held, a, b):
            s.close()
