"""Every read bounded before it is read (issue 37, item 4): an oversized finalize claim, an
export whose weights hold an extra tensor, a FIFO where a file should be (in an export, or at a
control record of a `file://` store), a config that claims 2^40 layers or positions (an
export's, a factory model's, a stored one `diloco export` reads, one given to `diloco init`,
a stored one an island or merger reads): each refused in one line before its bytes are read or
anything is built from it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save

from tests.gcs_fixture import BACKENDS, gcs_bucket  # noqa: F401  (fixture)
from tests.helpers import new_store, small_config
from training import cli
from training.config.experiment import ConfigError
from training.data.tokenizer import ByteTokenizer
from training.model import definition as model
from training.model.export import WEIGHTS, load_export, write_export
from training.store.objectstore import CorruptObject


@pytest.mark.parametrize("kind", BACKENDS[1:])
def test_an_oversized_finalize_claim_is_not_read_whole(kind, request, tmp_path):
    # 8 MiB where a 4 KiB claim belongs: bounded before the read (file: fstat; gs: a ranged
    # GET of at most 4 KiB + 1), the finalize held
    url = f"file://{tmp_path}/store"
    if kind == "gs":
        url = f"{request.getfixturevalue('gcs_bucket')}/fin-{tmp_path.name}"
    store = new_store(small_config("fin"), url)
    key = store.object_key("control/finalized.json")
    store.store.write(key, b"{" + b" " * (8 * 2**20) + b"}")
    assert store.claim_finalize("run-1") == "(an unreadable claim)"


@pytest.fixture
def export_dir(tmp_path):
    cfg = small_config("exp")
    params = {k: np.asarray(v) for k, v in model.init_params(cfg.model, 0).items()}
    out = tmp_path / "export"
    write_export(out, cfg, params, ByteTokenizer(), {"experiment": "exp"})
    assert load_export(out)[1].keys() == params.keys()  # the untampered export loads
    return out


def test_an_extra_tensor_in_the_weights_is_refused_by_size(export_dir):
    params = load_file(export_dir / WEIGHTS)
    params["extra"] = np.zeros(2**20, np.float32)  # 4 MiB more than the config describes
    (export_dir / WEIGHTS).write_bytes(save(params))
    with pytest.raises(
        ConfigError, match=r"bytes of tensors, but config.json describes [\d,]+ float32"
    ):
        load_export(export_dir)


def test_a_fifo_for_the_weights_is_refused_not_read(export_dir):
    (export_dir / WEIGHTS).unlink()
    os.mkfifo(export_dir / WEIGHTS)  # a read would wait for a writer forever
    with pytest.raises(ConfigError, match="model.safetensors: not a regular file"):
        load_export(export_dir)


def test_a_config_claiming_two_to_the_forty_layers_is_refused_before_building(export_dir):
    path = export_dir / "config.json"
    config = json.loads(path.read_text())
    config["model"]["n_layers"] = 2**40
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="describes"):
        load_export(export_dir)


def _export(tmp_path, **model_section):
    cfg = small_config("exp", model=model_section) if model_section else small_config("exp")
    params = {k: np.asarray(v) for k, v in model.init_params(cfg.model, 0).items()}
    out = tmp_path / "export"
    write_export(out, cfg, params, ByteTokenizer(), {"experiment": "exp"})
    return out


def _claim(out, **sizes):
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["model"].update(sizes)
    path.write_text(json.dumps(config))


def test_a_gemma_export_claiming_two_to_the_forty_positions_is_refused_by_sample(tmp_path, capsys):
    # a gemma model's parameters do not depend on max_seq_len (rotary positions): the weights
    # match, and sampling would build a key/value cache of 2^40 positions
    out = _export(tmp_path, preset="gemma-tiny", compute_dtype="float32")
    _claim(out, max_seq_len=2**40)
    assert cli.main(["sample", "--from", str(out), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("config.json: model: max_seq_len 1,099,511,627,776 is over the limit "
                        "1,048,576") and "\n" not in err  # fmt: skip


def test_a_factory_export_claiming_two_to_the_forty_layers_is_refused_before_building(
    tmp_path, monkeypatch
):
    # a factory model's parameter count is its own: no file size to hold it to, so its sizes
    # are bounded before the factory is called
    out = _export(tmp_path, factory="tests.byo_model:make")
    _claim(out, n_layers=2**40)
    monkeypatch.setattr(model, "definition", lambda cfg: pytest.fail("built"))
    with pytest.raises(ConfigError, match=r"n_layers 1,099,511,627,776 is over the limit 4,096"):
        load_export(out)


def test_a_factory_exports_extra_tensor_is_refused_from_its_header(tmp_path, monkeypatch):
    # the weights' header names a tensor the model has not: refused before any tensor is read
    out = _export(tmp_path, factory="tests.byo_model:make")
    params = load_file(out / WEIGHTS)
    params["extra"] = np.zeros(2**20, np.float32)
    (out / WEIGHTS).write_bytes(save(params))
    import safetensors.numpy

    monkeypatch.setattr(safetensors.numpy, "load_file", lambda *a: pytest.fail("read whole"))
    with pytest.raises(ConfigError, match=r"tensors missing \[\], unexpected \['extra'\]"):
        load_export(out)


def test_export_refuses_a_stored_model_section_its_tensors_are_not(tmp_path, capsys):
    # the store's config.json claims 3 layers where the stored tensors hold 2: the export would
    # write a config.json its weights are not (and one of 2^40 layers: bounded first)
    url = f"file://{tmp_path}/store"
    new_store(small_config("exp"), url)
    path = tmp_path / "store" / "exp" / "config.json"
    stored = json.loads(path.read_text())
    argv = ["export", "--store", url, "--experiment", "exp", "--out", str(tmp_path / "out")]
    for layers, why in [(3, "tensors missing ['blocks/2/"), (2**40, "over the limit 4,096")]:
        path.write_text(json.dumps({**stored, "model": {**stored["model"], "n_layers": layers}}))
        assert cli.main(argv) == 2 and not (tmp_path / "out").exists()
        assert why in capsys.readouterr().err


@pytest.mark.parametrize("relative", ["control/finalized.json", "fragments/f000/HEAD.json"])
def test_a_fifo_at_a_control_record_is_refused_not_read(tmp_path, relative):
    # file://: a FIFO where a record belongs would block every reader for a writer that never
    # comes; the open file is checked regular before a byte is read
    store = new_store(small_config("fifo"), f"file://{tmp_path}/store")
    path = tmp_path / "store" / "fifo" / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    key = store.object_key(relative)
    for read in (store.store.read, store.store.read_versioned, store.store.read_buffer):
        with pytest.raises(CorruptObject, match=f"{relative} is not a regular file"):
            read(key, max_bytes=4096)
    if relative == "control/finalized.json":
        assert store.claim_finalize("run-1") == "(an unreadable claim)"


# -- a model section's sizes bounded where a config enters (ModelConfig.bounded_dims) -----------

HUGE = "n_layers 1,099,511,627,776 is over the limit 4,096"


def test_init_refuses_a_model_beyond_the_bounds_in_one_line(tmp_path, capsys):
    url = f"file://{tmp_path}/store"
    argv = ["init", "--store", url, "--name", "big", "--set", "model.preset=tiny"]
    code = cli.main([*argv, "--set", f"model.n_layers={2**40}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("diloco init: error: invalid config:") and HUGE in err
    assert not (tmp_path / "store").exists()  # nothing written


@pytest.mark.parametrize("command", ["island", "merge"])
def test_a_stored_config_beyond_the_bounds_is_refused_before_anything_is_built(
    command, tmp_path, capsys, monkeypatch
):
    # config.json rewritten in the store to claim 2^40 layers: `diloco island` and `diloco
    # merge` refuse it in one line naming the object, before an island or merger is built
    from training.island.process import Island
    from training.merge.merger import Merger

    url = f"file://{tmp_path}/store"
    new_store(small_config("big"), url)
    path = tmp_path / "store" / "big" / "config.json"
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "model": {**stored["model"], "n_layers": 2**40}}))
    for cls in (Island, Merger):
        monkeypatch.setattr(cls, "__init__", lambda *a, **k: pytest.fail("built"))
    argv = {"island": ["--island", "a"], "merge": []}[command]
    assert cli.main([command, "--store", url, "--experiment", "big", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"diloco {command}: error: {url}/big/config.json: invalid config")
    assert HUGE in err
