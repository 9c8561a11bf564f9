"""A client's report and the scheduler's answer on the wire (scheduler/messages.py): round trips
into the coordinator, refusals naming the values, malformed and fuzzed messages only ever a
ValueError."""

import random
import re

import msgpack
import numpy as np
import pytest

from scheduler import CostModel
from scheduler.config import JobConfig, PlanConfig
from scheduler.coordinator import Coordinator
from scheduler.messages import decode_answer, decode_report, encode_answer, encode_report
from scheduler.parts import PlanPart

COST = CostModel(num_heads_q=4, num_heads_kv=2, head_dim=8, dtype_bytes=2)
SHAPE = {"cost": COST.to_wire(), "device_type": "cpu"}


@pytest.mark.parametrize("lens", [[5, 7, 1], [], np.array([3, 9], dtype=np.int32), [np.int64(4), 2],
                                  (2**63 - 1,), np.array([8], dtype=np.uint16)])
def test_report_round_trip(lens):
    data = encode_report(3, 1, 2, lens, SHAPE, token="ab12")
    assert type(data) is bytes
    step, batch, rank, doc_lens, shape, token = decode_report(data)
    assert (step, batch, rank, shape, token) == (3, 1, 2, SHAPE, "ab12")
    assert decode_report(encode_report(3, 1, 2, lens, SHAPE))[5] is None  # no token: the actor refuses it
    assert doc_lens == [int(x) for x in lens] and all(type(x) is int for x in doc_lens)


@pytest.mark.parametrize("lens, shown", [([2.5], "[2.5]"), ([True, 3], "[True, 3]"), ([4, -1], "[4, -1]"),
                                         ([[1, 2]], "[[1, 2]]"), ([2**64], "[18446744073709551616]"),
                                         (["7"], "['7']"), (np.array([1.0]), "[1.0]"),
                                         (np.array([[1, 2]]), "[1, 2]"), (np.array([True]), "[True]")])
def test_encode_refuses_what_is_not_token_counts(lens, shown):
    with pytest.raises(ValueError, match="doc_lens must be a 1-D sequence of ints in") as err:
        encode_report(0, 0, 0, lens, SHAPE)
    assert str(err.value).endswith(f"got {shown}")


def test_decode_refuses_malformed_reports():
    good = msgpack.unpackb(encode_report(0, 0, 1, [5, 6], SHAPE))
    cases = {
        b"\xc1": "not valid msgpack",
        msgpack.packb([1, 2]): "must be a map",
        msgpack.packb({**good, "extra": 1}): "unexpected ['extra']",
        msgpack.packb({k: v for k, v in good.items() if k != "token"}): "missing ['token']",
        msgpack.packb({**good, "format": "distca.part"}): "not a distca.report v2",
        msgpack.packb({**good, "version": 1}): "not a distca.report v2",
        msgpack.packb({**good, "doc_lens": [5, 6]}): "field 'doc_lens' must be int64 bytes",
        msgpack.packb({**good, "doc_lens": b"\x01" * 7}): "not a multiple of 8",
        msgpack.packb({**good, "doc_lens": np.array([-3], dtype="<i8").tobytes()}): "negative values: [-3]",
        "a str": "must be bytes",
    }
    for data, message in cases.items():
        with pytest.raises(ValueError) as err:
            decode_report(data)
        assert message in str(err.value), (data, str(err.value))


def test_fuzzed_reports_are_refused_or_decoded_never_crash():
    rng = random.Random(0)
    data = bytearray(encode_report(7, 0, 1, list(range(1, 40)), SHAPE))
    decoded = 0
    for _ in range(2000):
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        try:
            step, batch, rank, doc_lens, shape, token = decode_report(bytes(flipped))
        except ValueError:
            continue
        decoded += 1
        assert all(type(x) is int and x >= 0 for x in doc_lens)
    assert decoded > 0  # some flips only change values


def test_reports_through_the_wire_plan_like_in_process_ones():
    """Two clients' reports encoded and decoded reach the same plan as the in-process call, and
    the answers survive the answer encoding: the part stays the coordinator's msgpack bytes."""
    lens = [[300, 20, 5], [90, 1]]
    answers = {}
    for wire in (False, True):
        coord = Coordinator("wire", config=JobConfig(plan=PlanConfig(mode="inplace", min_shard=8)))
        for r in range(2):
            coord.register_client(r, 2, {"incarnation": f"i{r}"})
        for r in range(2):
            args = (0, 0, r, lens[r], SHAPE)
            coord.report(*(decode_report(encode_report(*args))[:5] if wire else args))
        coord.plan(0, 0)
        answers[wire] = [coord.answer(0, 0, r) for r in range(2)]
    assert answers[True] == answers[False]
    for r, answer in enumerate(answers[True]):
        back = decode_answer(encode_answer(answer))
        assert back == answer and type(back["part"]) is bytes
        part = PlanPart.from_msgpack(back["part"])
        assert (part.step, part.rank, part.doc_lens) == (0, r, lens[r])


def test_error_answers_round_trip_and_bad_answers_are_refused():
    coord = Coordinator("wire", config=JobConfig(plan=PlanConfig(mode="inplace")))
    answer = coord.report(0, 0, 0, [5], SHAPE).answer  # not registered
    assert decode_answer(encode_answer(answer)) == answer and answer["register"] is True
    for data, message in ((b"\xc1", "not valid msgpack"), (msgpack.packb([1]), "must be a map, got list")):
        with pytest.raises(ValueError, match="scheduler answer") as err:
            decode_answer(data)
        assert message in str(err.value)


# ---- the activation dtype in the shape (issue 23, defect 9) ---------------------------------------------
def _shape(dtype, cost=COST):
    return {"cost": cost.to_wire(), "device_type": "cpu", "window": None, "dtype": dtype}


def _report_both(shapes, lens=([5, 7], [9])):
    """Both clients of a fresh in-place job report step 0 with ``shapes[r]``; rank 1's outcome."""
    coord = Coordinator("dtypes", config=JobConfig(plan=PlanConfig(mode="inplace", min_shard=8)))
    for r in range(2):
        coord.register_client(r, 2, {"incarnation": f"i{r}"})
    coord.report(*decode_report(encode_report(0, 0, 0, lens[0], shapes[0]))[:5])
    return coord, coord.report(*decode_report(encode_report(0, 0, 1, lens[1], shapes[1]))[:5])


def test_clients_of_one_element_size_but_other_dtypes_disagree_with_a_value_error_for_both():
    """bfloat16 and float16 have the same cost (2-byte elements): only the dtype's name tells them
    apart, before any round mixes them. Every client gets the same ValueError naming each rank's."""
    coord, out = _report_both([_shape("bfloat16"), _shape("float16")])
    assert out.resolved and not out.plan and out.answer["error"] == "ValueError"
    assert coord.answer(0, 0, 0) == coord.answer(0, 0, 1) == out.answer
    message = out.answer["message"]
    assert message.startswith("clients disagree on the attention shape: ranks [0] sent ")
    assert "ranks [0] sent {'cost': [4, 2, 8, 2], 'device_type': 'cpu', 'window': None, 'dtype': 'bfloat16'}" in message
    assert "ranks [1] sent {'cost': [4, 2, 8, 2], 'device_type': 'cpu', 'window': None, 'dtype': 'float16'}" in message


@pytest.mark.parametrize("shapes, plans", [
    ([_shape("bfloat16"), _shape("bfloat16")], True),
    ([SHAPE, SHAPE], True),  # reports without a dtype (an older client): accepted as before
    ([SHAPE, dict(SHAPE, dtype=None)], True),  # None is "not stated" too
    ([SHAPE, _shape("float16")], False),  # one stated, one not: cannot be checked, refused
])
def test_agreeing_dtypes_plan_and_unstated_ones_only_agree_with_each_other(shapes, plans):
    coord, out = _report_both(shapes)
    assert out.plan is plans and (out.answer is None) is plans, out
    if not plans:
        assert "'dtype': None" in out.answer["message"] and "'dtype': 'float16'" in out.answer["message"]


@pytest.mark.parametrize("dtype, match", [
    ("int8", r"rank 1: dtype must be one of \('float16', 'bfloat16', 'float32', 'float64'\) or None, got 'int8'"),
    (2, r"rank 1: dtype must be one of .* got 2"),
    (["float16"], r"rank 1: dtype must be one of .* got \['float16'\]"),
    ("float32", r"rank 1: dtype float32 has 4-byte elements but the attention shape says 2"),
])
def test_a_bad_dtype_is_refused_naming_the_rank(dtype, match):
    _, out = _report_both([_shape("float16"), _shape(dtype)])
    assert out.answer["error"] == "ValueError" and re.search(match, out.answer["message"]), out.answer


def test_dtype_names_are_torch_names_of_the_client_dtypes():
    """The client sends ``str(dtype)`` without ``torch.`` (ray_client.step_for): every dtype
    ``attend`` accepts has a name and element size the scheduler knows."""
    torch = pytest.importorskip("torch")
    from distca_client.validate import FLOAT_DTYPES
    from scheduler.messages import DTYPE_BYTES
    assert {str(d).removeprefix("torch."): d.itemsize for d in FLOAT_DTYPES} == DTYPE_BYTES
    assert torch.bfloat16 in FLOAT_DTYPES
