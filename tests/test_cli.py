"""The `diloco` command: bad input ends with one line on stderr, exit 2, nothing half-written."""

import json
import socket

import pytest

from training import cli
from training.store.experiment import ExperimentStore
from training.store.registry import open_store


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_init_refuses_a_name_with_path_separators(tmp_path, capsys):
    code, _, err = _run(capsys, "init", "--store", f"file://{tmp_path}", "--name", "../evil")
    assert code == 2
    assert "invalid experiment name '../evil'" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_init_refuses_an_unknown_preset_before_writing(tmp_path, capsys):
    code, _, err = _run(
        capsys, "init", "--store", f"file://{tmp_path}", "--name", "e", "--set", "model.preset=huge"
    )
    assert code == 2 and "model.preset" in err
    assert list(tmp_path.iterdir()) == []


def test_init_fails_fast_on_an_unreachable_bucket(monkeypatch, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    code, _, err = _run(capsys, "init", "--store", "gs://no-such-bucket/x", "--name", "e")
    assert code == 2 and "error:" in err and err.count("\n") == 1


def test_init_then_status_and_a_corrupt_global_version(tmp_path, capsys):
    url = f"file://{tmp_path}"
    small = json.dumps(
        {"preset": "tiny", "d_model": 32, "n_heads": 2, "d_ff": 64, "max_seq_len": 32}
    )
    code, out, _ = _run(
        capsys,
        "init",
        "--store",
        url,
        "--name",
        "e",
        "--set",
        f"model={small}",
        "--set",
        "data.seq_len=32",
    )
    assert code == 0 and "created version 0" in out
    code, out, _ = _run(capsys, "status", "--store", url, "--experiment", "e")
    # the default P = 4 tensor fragments, each at version 0
    assert code == 0 and "fragment versions [0, 0, 0, 0]" in out and "island-0" in out
    store = ExperimentStore(open_store(url), "e")
    params = f"e/{store.head(0).dir}/params.safetensors"
    data = bytearray(store.store.read(params))
    data[-1] ^= 0xFF
    store.store.write(params, bytes(data))
    code, _, err = _run(capsys, "eval", "--store", url, "--experiment", "e")
    assert code == 2 and "checksum" in err.lower() and err.count("\n") == 1


def test_init_takes_a_config_file_without_name_and_store(tmp_path, capsys):
    # --name and --store are required flags: the file need not repeat them (it used to be
    # refused with "name: Field required")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"preset": "tiny", "d_model": 32, "n_heads": 2}}))
    url = f"file://{tmp_path / 'store'}"
    code, out, err = _run(capsys, "init", "--store", url, "--name", "e", "--config", str(path))
    assert (code, err) == (0, "") and "created version 0" in out
    cfg = ExperimentStore(open_store(url), "e").read_config()
    assert (cfg["name"], cfg["store_url"], cfg["model"]["d_model"]) == ("e", url, 32)


@pytest.mark.parametrize("argv", [["island"], ["merge", "--store", "file:///tmp"]])
def test_missing_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
