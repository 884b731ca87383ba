"""`diloco bench light`: the bytes a merge writes with light versions, and a cold start's time."""

from __future__ import annotations

import json

from training.bench import light


def test_light_versions_write_fewer_bytes_and_a_cold_start_replays_them(tmp_path, capsys):
    out_path = tmp_path / "light.json"
    argv = ["--preset", "tiny", "--fragments", "1", "--bytes-k", "1", "4", "--bytes-merges", "4"]
    argv += ["--cold-k", "1", "3", "--json", str(out_path)]
    assert light.main(argv) == 0
    out = json.loads(out_path.read_text())
    full, light_k4 = out["bytes"]["1"], out["bytes"]["4"]
    # k = 4 over versions 1-4: three light versions (params + update) and one full one (params,
    # outer state, shadow, update): fewer bytes a merge than four full versions
    assert light_k4["bytes_per_merge"] < full["bytes_per_merge"]
    # the full version 4 written in the background (update + promoted params, outer state,
    # shadow) or by the merge (the same four payloads): the same bytes
    assert (
        light_k4["bytes_per_merge"] == out["bytes"]["4 (written by the merge)"]["bytes_per_merge"]
    )
    # full_every 3: HEAD = 2, both versions after the full version 0 light, replayed cold,
    # then promoted and loaded
    assert out["cold"]["3"]["head"] == 2
    assert out["cold"]["3"]["promoted_start_s"] > 0
    assert "| full_every | HEAD | cold start s | cold start at a promoted HEAD" in (
        capsys.readouterr().out
    )
