"""The main job end to end: asynchronous RL on the reference engine's toy MoE model.

``rollout-gateway demo`` (``rollout_demo.cli``) starts reference engines and the gateway as
the product runs them, generates rollouts through the gateway's HTTP API while a learner
(``rollout_demo.learner``, plain PyTorch on the engine's own weights) pulls them over gRPC,
trains with a chosen correction and hot-swaps its weights into the engines after every
optimizer step. ``rollout_demo.lab`` is the staleness lab (controlled lag, in-process).

This package is the one place that imports both ``rollout_gateway`` (to start the services)
and ``learner_client`` (to learn); neither of those imports the other.
"""
