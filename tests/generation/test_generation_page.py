"""docs/generation.md's server loop (its first python block; tests/tooling/test_docs.py runs every block):
under 30 lines, and every request it serves finishes with the tokens it gets alone."""

from __future__ import annotations

import re
from pathlib import Path

from recurrent_cache.generation import Generator

PAGE = Path(__file__).resolve().parents[2] / "docs" / "generation.md"


def test_the_server_loop_is_short_and_serves_every_request_as_alone(capsys):
    loop = re.search(r"^```python\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.M | re.S).group(1)
    assert len(loop.splitlines()) < 30
    namespace: dict = {}
    exec(compile(loop, str(PAGE), "exec"), namespace)
    handles = namespace["handles"]
    requests = [r for handle in handles for r in [handle, *handle.forks]]
    assert len(handles) == 4 and len(requests) == 5 and namespace["generator"].done
    assert namespace["generator"].stats.peak_sequences == 3
    printed = capsys.readouterr().out
    for request in requests:
        assert request.finished and f"{request.id} {request.finish_reason} " in printed
        sampler = request.sampler
        solo = Generator(namespace["model"]).generate([request.prompt], max_new_tokens=request.max_new_tokens,
                                                      stop=request.stop_strings, temperature=sampler.temperature,
                                                      top_k=sampler.top_k, seed=sampler.seed)[0]
        assert request.tokens == solo.tokens
