"""Pure rules: roles, group-bound learner tokens, constant-time lookup, secrets kept out of
reprs, the bind check, and what a client may see of an error."""

from __future__ import annotations

import pytest

from rollout_gateway.api.security import public_view
from rollout_gateway.auth import Authenticator, Role, bearer
from rollout_gateway.errors import InvalidArgument, PermissionDenied, Unauthenticated
from rollout_gateway.redact import clean_message
from rollout_gateway.commands.serve import check_bind, is_loopback
from rollout_gateway.settings import load_settings

ADMIN, LEARNER, CLIENT, JOB_A = "a" * 20, "l" * 20, "c" * 20, "j" * 20


def auth(**kw) -> Authenticator:
    return Authenticator(**{"admin": ADMIN, "learner": LEARNER, "client": CLIENT,
                            "jobs": [(JOB_A, ["job-a", "job-a-*"])], **kw})


def test_each_role_needs_its_token_and_admin_opens_everything():
    a = auth()
    for role, own in ((Role.ADMIN, ADMIN), (Role.LEARNER, LEARNER), (Role.CLIENT, CLIENT)):
        assert a.require(f"Bearer {own}", role).role in (role,)
        assert a.require(f"Bearer {ADMIN}", role).role is Role.ADMIN
        with pytest.raises(Unauthenticated):
            a.require(None, role)
        with pytest.raises(Unauthenticated):
            a.require(f"Bearer {own}x", role)
        with pytest.raises(Unauthenticated):
            a.require(own, role)  # no scheme
    with pytest.raises(PermissionDenied):
        a.require(f"Bearer {LEARNER}", Role.ADMIN)
    with pytest.raises(PermissionDenied):
        a.require(f"Bearer {CLIENT}", Role.LEARNER)
    with pytest.raises(PermissionDenied):
        a.require(f"Bearer {JOB_A}", Role.CLIENT)
    assert a.require(f"bearer   {LEARNER} ", Role.LEARNER).role is Role.LEARNER


def test_job_tokens_only_touch_their_groups():
    a = auth()
    p = a.require(f"Bearer {JOB_A}", Role.LEARNER)
    for ok in ("job-a", "job-a-", "job-a-eval"):
        a.check_group(p, ok)
    for bad in ("job-b", "job-ab", "job", "other"):
        with pytest.raises(PermissionDenied):
            a.check_group(p, bad)
    a.check_group(a.require(f"Bearer {LEARNER}", Role.LEARNER), "job-b")  # shared key: all


def test_unconfigured_roles_are_open_but_job_limits_still_hold():
    a = Authenticator(admin=ADMIN, jobs=[(JOB_A, ["job-a"])])
    assert a.open_for(Role.CLIENT) and not a.open_for(Role.LEARNER)
    assert a.require(None, Role.CLIENT) is not None
    nothing = Authenticator()
    assert not nothing.enabled and nothing.open_for(Role.ADMIN)
    assert not nothing.is_admin(f"Bearer {ADMIN}")


def test_lookup_handles_odd_tokens():
    a = auth()
    assert a.identify("\udcff") is None  # not UTF-8 encodable: no crash
    assert a.identify("") is None
    assert bearer("Basic abc") is None and bearer("Bearer ") is None


def test_keys_never_show_in_settings_reprs():
    s = load_settings(admin_api_key=ADMIN, learner_api_key=LEARNER, client_api_key=CLIENT,
                      learner_jobs=[{"token": JOB_A, "groups": ["job-a"]}])
    text = repr(s) + str(s) + s.model_dump_json()
    for secret in (ADMIN, LEARNER, CLIENT, JOB_A):
        assert secret not in text
    assert s.admin_api_key.get_secret_value() == ADMIN
    with pytest.raises(InvalidArgument):
        load_settings(admin_api_key="short")
    with pytest.raises(InvalidArgument):
        load_settings(learner_jobs=[{"token": JOB_A, "groups": ["*"]}])


def test_bind_check():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("gw")
    check_bind(load_settings())  # defaults are loopback
    with pytest.raises(InvalidArgument, match="LEARNER_API_KEY"):
        check_bind(load_settings(http_host="0.0.0.0", admin_api_key=ADMIN))
    with pytest.raises(InvalidArgument, match="ADMIN_API_KEY"):
        check_bind(load_settings(grpc_host="0.0.0.0", learner_api_key=LEARNER))
    # the client routes are on the HTTP port: its public bind needs the client key too
    with pytest.raises(InvalidArgument, match="CLIENT_API_KEY") as err:
        check_bind(load_settings(http_host="0.0.0.0", admin_api_key=ADMIN,
                                 learner_api_key=LEARNER))
    assert "ADMIN_API_KEY" not in str(err.value) and "LEARNER_API_KEY" not in str(err.value)
    check_bind(load_settings(grpc_host="0.0.0.0", admin_api_key=ADMIN, learner_api_key=LEARNER))
    check_bind(load_settings(http_host="0.0.0.0", grpc_host="::", admin_api_key=ADMIN,
                             client_api_key=CLIENT,
                             learner_jobs=[{"token": JOB_A, "groups": ["job-a"]}]))
    check_bind(load_settings(http_host="0.0.0.0", insecure=True))


def test_tls_settings_go_together():
    with pytest.raises(InvalidArgument):
        load_settings(tls_cert_file="/x.pem")
    with pytest.raises(InvalidArgument):
        load_settings(grpc_client_ca_file="/ca.pem")


@pytest.mark.parametrize("raw,gone", [
    ("engine e0 /generate: ConnectError: [Errno 111] Connection refused", "ConnectError"),
    ("engine e0 at http://10.0.0.7:30000/generate failed", "10.0.0.7"),
    ("redis failed: Error 111 connecting to 127.0.0.1:6379. Connection refused.", "6379"),
    ("redis failed: Error connecting to redis-master:6379.", "redis-master"),
    ("cannot open store journal '/var/lib/gw/journal.db': denied", "/var/lib"),
    ("bad [fe80::1]:8000 peer", "fe80"),
    ("x\nTraceback (most recent call last):\n  File \"/a/b.py\", line 1", "Traceback"),
    ("httpx.ReadTimeout: timed out", "ReadTimeout"),
])
def test_client_messages_carry_no_internals(raw, gone):
    out = clean_message(raw)
    assert gone not in out and out
    assert "/v1/weights" in clean_message("see /v1/weights")  # API paths stay


def test_public_view_drops_sources_and_urls():
    snap = {"learner_version": 1, "swap_leader": "host-7:123", "recent_swaps": [
        {"version": 1, "source": "/ckpt/secret/v1", "leader": "host-7:123",
         "message": "load of /ckpt/secret/v1 failed", "engines": {"e0": {"error": "x"}}}],
            "url": "http://10.0.0.1:1"}
    out = public_view(snap)
    text = str(out)
    assert "secret" not in text and "host-7" not in text and "10.0.0.1" not in text
    assert out["recent_swaps"][0]["version"] == 1 and out["learner_version"] == 1


async def test_grpc_errors_carry_no_internals():
    import grpc

    from rollout_gateway.errors import StoreError
    from rollout_gateway.transport.servicer import _abort

    class Ctx:
        async def abort(self, code, message):
            self.got = (code, message)
            raise grpc.aio.AbortError()

    for private, shown in ((True, False), (False, True)):
        ctx = Ctx()
        with pytest.raises(grpc.aio.AbortError):
            await _abort(ctx, StoreError("redis xadd failed: ConnectionError: Error 111 "
                                         "connecting to 10.0.0.5:6379"), private=private)
        code, message = ctx.got
        assert code == grpc.StatusCode.UNAVAILABLE and "redis xadd failed" in message
        assert "ConnectionError" not in message and ("10.0.0.5" in message) is shown
    ctx = Ctx()
    with pytest.raises(grpc.aio.AbortError):
        await _abort(ctx, ZeroDivisionError("secret /etc/x"))
    assert ctx.got == (grpc.StatusCode.INTERNAL, "internal error in the trajectory service")


def test_client_tokens_belong_to_tenants():
    ta, tb = "t" * 20, "u" * 20
    a = auth(tenants=[("team-a", ta), ("team-b", tb)])
    assert a.require(f"Bearer {CLIENT}", Role.CLIENT).tenant == "default"
    assert a.require(f"Bearer {ta}", Role.CLIENT).tenant == "team-a"
    assert a.require(f"Bearer {tb}", Role.CLIENT).owner == "team-b"
    admin = a.require(f"Bearer {ADMIN}", Role.CLIENT)
    assert admin.sees_all and admin.owner == "default"
    assert not a.require(f"Bearer {ta}", Role.CLIENT).sees_all
    with pytest.raises(PermissionDenied):  # a client token is no learner's
        a.require(f"Bearer {ta}", Role.LEARNER)
    assert a.tenant_of(f"Bearer {tb}") == "team-b" and a.tenant_of("Bearer nobody") is None
    only_tenants = Authenticator(admin=ADMIN, tenants=[("team-a", ta)])
    assert not only_tenants.open_for(Role.CLIENT)  # a tenant closes the client role
    with pytest.raises(Unauthenticated):
        only_tenants.require(None, Role.CLIENT)
    open_ = Authenticator(admin=ADMIN)
    p = open_.require(None, Role.CLIENT)
    assert p.owner == "default" and not p.sees_all  # anonymous: its own tenant only
    assert open_.tenant_of(None) == "default"


@pytest.mark.parametrize("tenants, client, why", [
    ([{"name": "a", "token": "x" * 20}, {"name": "a", "token": "y" * 20}], None, "unique"),
    ([{"name": "default", "token": "x" * 20}], "c" * 20, "default"),
    ([{"name": "a", "token": "c" * 20}], "c" * 20, "own token"),
    ([{"name": "a b", "token": "x" * 20}], None, "pattern"),
    ([{"name": "a", "token": "short"}], None, "at least 16"),
])
def test_bad_tenant_settings_are_refused(tenants, client, why):
    from pydantic import ValidationError

    from rollout_gateway.settings import GatewaySettings

    with pytest.raises(ValidationError) as ei:
        GatewaySettings(client_tenants=tenants, client_api_key=client)
    assert why in str(ei.value), str(ei.value)
