"""SGLang's weight-version span rule (pure; no torch)."""

from __future__ import annotations

from reference_engine.request import VersionEvent


def weight_version_spans(events: list[VersionEvent], current: str, n_out: int) -> list[dict]:
    """SGLang's ``compute_weight_version_spans``: ``[{version, start, end}]`` over output
    indices, ``end`` exclusive, adjacent equal versions merged, empty spans dropped."""
    spans: list[dict] = []
    for version, end in [*((e.old_version, e.num_output_tokens) for e in events), (current, n_out)]:
        end = min(end, n_out)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans
