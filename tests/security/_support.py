"""Shared settings of the security suite's gateways."""

#: a shared 2-core machine under load answers health probes late: these gateways take an
#: engine out of rotation only when it is really gone (these tests are not about failover)
PATIENT_HEALTH = {"ROLLOUT_GATEWAY_HEALTH_INTERVAL_S": "2", "ROLLOUT_GATEWAY_UNHEALTHY_AFTER": "5",
                  "ROLLOUT_GATEWAY_TIMEOUTS__HEALTH_S": "10"}
