"""Never two finalizes of one experiment (issue 24 item 3): the claim of `control/finalized.json`
is create-only (ExperimentStore.claim_finalize, training/store/syncer_control.py); its record is strict."""

from __future__ import annotations

import json
import uuid

import pytest

from training.store.experiment import ExperimentStore
from training.store.keys import FINALIZED, parse_key
from training.store.registry import open_store
from training.store.syncer_records import BadFinalized, parse_finalized


@pytest.fixture
def estore():
    return ExperimentStore(open_store(f"memory://finalize-{uuid.uuid4().hex[:8]}"), "exp")


def test_the_first_run_claims_the_finalize_and_a_second_run_is_told_who_did(estore):
    assert estore.claim_finalize("scheduled__1") is None
    assert estore.claim_finalize("scheduled__2") == "scheduled__1"


def test_a_retry_of_the_claiming_run_goes_on(estore):
    assert estore.claim_finalize("manual__1") is None
    assert estore.claim_finalize("manual__1") is None


def test_the_claim_is_a_known_object_name():
    assert parse_key(FINALIZED).kind == "finalized"


@pytest.mark.parametrize(
    "record",
    [
        {"run_id": "r"},
        {"run_id": "r", "at": -1},
        {"run_id": 3, "at": 1},
        {"run_id": "r", "at": 1, "x": 0},
    ],
)
def test_a_bad_claim_is_refused(record):
    with pytest.raises(BadFinalized):
        parse_finalized(json.dumps(record).encode())
