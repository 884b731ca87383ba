"""Every read bounded before it is read (issue 37, item 4): an oversized finalize claim, an
export whose weights hold an extra tensor, a FIFO where a file should be, a config that claims
2^40 layers: each refused in one line before its bytes are read or anything is built from it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save

from tests.helpers import new_store, small_config
from training.config.experiment import ConfigError
from training.data.tokenizer import ByteTokenizer
from training.model import definition as model
from training.model.export import WEIGHTS, load_export, write_export


def test_an_oversized_finalize_claim_is_not_read_whole(tmp_path):
    # 64 MiB where a 4 KiB claim belongs: bounded before the read, the finalize held
    store = new_store(small_config("fin"), f"file://{tmp_path}/store")
    key = store.object_key("control/finalized.json")
    store.store.write(key, b"{" + b" " * (64 * 2**20) + b"}")
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
