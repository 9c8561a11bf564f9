"""Plan.from_msgpack refuses every malformed descriptor with a ValueError: 1,000 messages invalid by
construction (random bytes, truncations, trailing garbage, wrong types, missing or renamed keys, one
field mutated) and bit-flip fuzzing of a valid one. Base plans and map helpers: test_descriptor.py."""

import copy
import math

import msgpack
import numpy as np
import pytest

from scheduler import Plan
from test_descriptor import I64, KEYS, base_plans, decode_map, ints, pack, put, tasks_of


def doc_len_of(obj, rank, doc):
    counts = ints(obj, "doc_counts")
    return int(ints(obj, "doc_lens")[int(counts[:rank].sum()) + doc])


# Each mutator takes (obj, rng) for a valid plan map and returns an invalid map (by construction)
# or None when it does not apply to this plan.
def m_doc_len_negative(obj, rng):
    lens = ints(obj, "doc_lens")
    lens[rng.integers(len(lens))] = -int(rng.integers(1, 2**40))
    return put(obj, "doc_lens", lens)


def m_doc_len_zero(obj, rng):
    lens = ints(obj, "doc_lens")
    lens[rng.integers(len(lens))] = 0
    return put(obj, "doc_lens", lens)


def m_doc_len_shorter(obj, rng):  # the last shard now ends past the document (or length 0)
    lens = ints(obj, "doc_lens")
    lens[rng.integers(len(lens))] -= int(rng.integers(1, 3))
    if (lens < 0).any():
        return None
    return put(obj, "doc_lens", lens)


def m_doc_len_longer(obj, rng):  # the shards stop before the end
    lens = ints(obj, "doc_lens")
    lens[rng.integers(len(lens))] += int(rng.integers(1, 1000))
    return put(obj, "doc_lens", lens)


def m_version(obj, rng):
    obj["version"] = [0, 1, -1, "3", None, 3.0, [3], 2**40, b"\x03", {"v": 3}, 2][rng.integers(11)]
    return obj


def m_format(obj, rng):
    obj["format"] = ["distca.plan.v2", "", b"distca.plan", None, 1, "DISTCA.PLAN",
                     ["distca.plan"]][rng.integers(7)]
    return obj


def m_mode(obj, rng):
    obj["mode"] = ["foo", "", "INPLACE", None, 0, b"inplace", ["inplace"], "dedicated ",
                   True][rng.integers(9)]
    return obj


def m_mode_inplace_mismatch(obj, rng):
    if len(ints(obj, "doc_counts")) == obj["num_servers"]:
        return None
    obj["mode"] = "inplace"
    return obj


def m_bin_not_multiple_of_8(obj, rng):
    key = ["tasks", "doc_lens", "doc_counts", "task_counts"][rng.integers(4)]
    raw = obj[key]
    if rng.integers(2) or len(raw) < 8:
        obj[key] = raw + rng.bytes(int(rng.integers(1, 8)))
    else:
        obj[key] = raw[: len(raw) - int(rng.integers(1, 8))]
    return obj


def m_tasks_not_multiple_of_48(obj, rng):
    raw = obj["tasks"]
    k = int(rng.integers(1, 6))
    if rng.integers(2):
        obj["tasks"] = raw + np.zeros(k, dtype=I64).tobytes()
    else:
        obj["tasks"] = raw[: len(raw) - 8 * k]
    return obj


def m_extra_task_row(obj, rng):  # 48 more bytes than task_counts says
    t = tasks_of(obj)
    return put(obj, "tasks", np.vstack([t, t[rng.integers(len(t))]]))


def m_task_counts_sum(obj, rng):
    tc = ints(obj, "task_counts")
    s = int(rng.integers(len(tc)))
    if tc[s] > 0 and rng.integers(2):
        tc[s] -= 1
    else:
        tc[s] += int(rng.integers(1, 4))
    return put(obj, "task_counts", tc)


def m_task_counts_length(obj, rng):
    tc = ints(obj, "task_counts")
    if rng.integers(2):
        tc = np.append(tc, 0)
    elif tc[-1] == 0:
        tc = tc[:-1]
    else:
        return None
    return put(obj, "task_counts", tc)


def m_task_overlap(obj, rng):
    t = tasks_of(obj)
    split = np.flatnonzero(t[:, 2] > 0)
    if len(split) and rng.integers(2):
        i = split[rng.integers(len(split))]
        t[i, 2] -= 1  # starts inside the previous shard
        return put(obj, "tasks", t)
    # duplicate a task on its own server: the document's rows are covered twice
    tc = ints(obj, "task_counts")
    i = int(rng.integers(len(t)))
    server = int(np.searchsorted(np.cumsum(tc), i, side="right"))
    t = np.insert(t, i, t[i], axis=0)
    tc[server] += 1
    put(obj, "task_counts", tc)
    return put(obj, "tasks", t)


def m_task_gap(obj, rng):
    t = tasks_of(obj)
    i = rng.integers(len(t))
    t[i, 2] += 1  # q_start + 1: a gap, a first shard not at 0, or an empty shard
    return put(obj, "tasks", t)


def m_task_longer(obj, rng):
    t = tasks_of(obj)
    i = rng.integers(len(t))
    t[i, 3] += 1  # overlaps the next shard or runs past the document
    t[i, 5] += 1
    return put(obj, "tasks", t)


def m_task_dropped(obj, rng):
    t = tasks_of(obj)
    tc = ints(obj, "task_counts")
    i = int(rng.integers(len(t)))
    server = int(np.searchsorted(np.cumsum(tc), i, side="right"))
    tc[server] -= 1
    put(obj, "task_counts", tc)
    return put(obj, "tasks", np.delete(t, i, axis=0))


def m_kv_end(obj, rng):
    t = tasks_of(obj)
    i = rng.integers(len(t))
    t[i, 5] += 1 if rng.integers(2) else -1
    return put(obj, "tasks", t)


def m_kv_start(obj, rng):
    t = tasks_of(obj)
    t[rng.integers(len(t)), 4] = int(rng.integers(1, 4))
    return put(obj, "tasks", t)


def m_q_end_past_doc(obj, rng):
    t = tasks_of(obj)
    i = int(rng.integers(len(t)))
    end = doc_len_of(obj, int(t[i, 0]), int(t[i, 1])) + int(rng.integers(1, 10))
    t[i, 3] = t[i, 5] = end
    return put(obj, "tasks", t)


def m_src_rank(obj, rng):
    t = tasks_of(obj)
    t[rng.integers(len(t)), 0] = len(ints(obj, "doc_counts")) + int(rng.integers(0, 4))
    return put(obj, "tasks", t)


def m_doc_index(obj, rng):
    t = tasks_of(obj)
    i = int(rng.integers(len(t)))
    t[i, 1] = ints(obj, "doc_counts")[t[i, 0]] + int(rng.integers(0, 4))
    return put(obj, "tasks", t)


def m_task_negative(obj, rng):
    t = tasks_of(obj)
    t[rng.integers(len(t)), rng.integers(6)] = -int(rng.integers(1, 100))
    return put(obj, "tasks", t)


def m_num_servers(obj, rng):
    obj["num_servers"] = [0, -1, True, False, 1.5, "2", None, 2**21, [1], 2**64 - 1,
                          obj["num_servers"] + 1][rng.integers(11)]
    return obj


def m_cost(obj, rng):
    obj["cost"] = [[32, 7, 128, 2], [0, 1, 1, 2], [4, 2, 8, 3], [4, 2, 8], [4, 2, 8, 2, 1],
                   [True, 1, 8, 2], [4, 2, 8, False], [4.0, 2, 8, 2], "llama", None, {"a": 1},
                   [4, -2, 8, 2], [4, 2, 8, 16], [4, 8, 8, 2]][rng.integers(14)]
    return obj


def m_epsilon(obj, rng):
    obj["epsilon"] = [math.nan, math.inf, -math.inf, -0.5, -1e-300, "0.05", None, True,
                      [0.05], -1][rng.integers(10)]
    return obj


def m_window(obj, rng):
    obj["window"] = [0, -1, True, 1.5, "128", [16], 2**63, {"w": 1}][rng.integers(8)]
    return obj


def m_window_disagrees(obj, rng):  # tasks cut for another window (or for none)
    tasks = tasks_of(obj)
    w = obj["window"]
    # kv_start == max(0, q_start - W + 1): with window 1 every task starting past 0 needs keys
    # from its q_start, with no window from 0.
    obj["window"] = 1 if w is None else None
    if not ((tasks[:, 2] >= 1) if w is None else (tasks[:, 2] >= w)).any():
        obj["window"] = w
        tasks[0, 4] += 1  # kv_start past the one the window asks for
        put(obj, "tasks", tasks)
    return obj


def m_min_shard(obj, rng):
    obj["min_shard"] = [0, -1, True, 1.5, "128", None, [16], 2**63, 2**64 - 1][rng.integers(9)]
    return obj


def m_min_shard_above_a_shard(obj, rng):  # a split document has a shard shorter than min_shard
    t = tasks_of(obj)
    docs, counts = np.unique(t[:, :2], axis=0, return_counts=True)
    split = {tuple(d) for d, n in zip(docs.tolist(), counts.tolist()) if n > 1}
    shards = [int(r[3] - r[2]) for r in t if (int(r[0]), int(r[1])) in split]
    if not shards:
        return None
    obj["min_shard"] = min(shards) + int(rng.integers(1, 100))
    return obj


def m_doc_counts(obj, rng):
    dc = ints(obj, "doc_counts")
    choice = int(rng.integers(4))
    if choice == 0:
        dc[rng.integers(len(dc))] += int(rng.integers(1, 3))
    elif choice == 1:
        dc = dc[:0]  # no ranks at all
    elif choice == 2:
        dc[rng.integers(len(dc))] = -1
    else:
        nz = np.flatnonzero(dc)
        i = int(nz[rng.integers(len(nz))])
        dc[i] -= 1
    return put(obj, "doc_counts", dc)


def m_doc_moves_rank(obj, rng):  # same total, one document moved to the next rank
    dc = ints(obj, "doc_counts")
    cand = [r for r in range(len(dc) - 1) if dc[r] > 0]
    if not cand:
        return None
    r = cand[rng.integers(len(cand))]
    dc[r] -= 1
    dc[r + 1] += 1
    return put(obj, "doc_counts", dc)


def m_extra_empty_rank(obj, rng):  # one more rank than inplace servers
    if obj["mode"] != "inplace":
        return None
    return put(obj, "doc_counts", np.append(ints(obj, "doc_counts"), 0))


def m_bin_wrong_type(obj, rng):
    key = ["tasks", "doc_lens", "doc_counts", "task_counts"][rng.integers(4)]
    choices = [np.frombuffer(obj[key], dtype=I64).tolist(), obj[key].hex(), 7, None, True,
               1.5, {"x": obj[key]}]
    obj[key] = choices[rng.integers(len(choices))]
    return obj


MUTATORS = [m_doc_len_negative, m_doc_len_zero, m_doc_len_shorter, m_doc_len_longer, m_version,
            m_format, m_mode, m_mode_inplace_mismatch, m_bin_not_multiple_of_8,
            m_tasks_not_multiple_of_48, m_extra_task_row, m_task_counts_sum, m_task_counts_length,
            m_task_overlap, m_task_gap, m_task_longer, m_task_dropped, m_kv_end, m_kv_start,
            m_q_end_past_doc, m_src_rank, m_doc_index, m_task_negative, m_num_servers, m_cost,
            m_epsilon, m_doc_counts, m_doc_moves_rank, m_extra_empty_rank, m_bin_wrong_type,
            m_min_shard, m_min_shard_above_a_shard, m_window, m_window_disagrees]


def malformed_messages():
    """Exactly 1,000 (label, bytes) pairs, each invalid by construction."""
    rng = np.random.default_rng(2024)
    bases = base_plans()
    valid = [p.to_msgpack() for p in bases]
    maps = [decode_map(p) for p in bases]
    out = []

    # 1. random bytes of random lengths (150), and random bytes behind a 10-entry map header (50)
    for i in range(150):
        out.append(("random", rng.bytes(int(rng.integers(0, 300)))))
    for i in range(50):
        out.append(("random-map", b"\x8a" + rng.bytes(int(rng.integers(0, 300)))))

    # 2. truncations (200): 100 prefixes of the smallest message evenly spread, then 100 cuts at
    #    structured positions (a key's marker, inside the key, the value's header, inside the value)
    smallest = min(valid, key=len)
    step = max(1, len(smallest) // 100)
    for n in list(range(0, len(smallest), step))[:99] + [len(smallest) - 1]:
        out.append((f"truncate-{n}", smallest[:n]))
    structured = []
    for b, data in enumerate(valid):
        for key in KEYS:
            pos = data.find(msgpack.packb(key))
            for off in (0, 1, len(key), len(key) + 1, len(key) + 2, len(key) + 5, len(key) + 12):
                if pos + off < len(data):
                    structured.append((f"truncate-{b}-{key}+{off}", data[: pos + off]))
    for j in rng.permutation(len(structured))[:100]:
        out.append(structured[j])
    assert len(out) == 400

    # 3. trailing garbage after a valid message (30)
    for i in range(30):
        data = valid[i % len(valid)]
        out.append(("trailing", data + rng.bytes(int(rng.integers(1, 10)))))

    # 4. valid msgpack of the wrong type (100)
    wrong = [0, 1, -1, 2**63, -(2**63), 1.5, math.nan, None, True, False, "", "distca.plan",
             b"", b"\x00" * 8, [], [1, 2, 3], [valid[0]], {}, {"format": "distca.plan"},
             list(maps[0].values()), list(maps[0].keys()), [maps[0]], {1: 2}, {b"format": 1},
             msgpack.ExtType(5, b"abc"), "x" * 1000, [[]], [None] * 10]
    for i in range(100):
        base = wrong[i % len(wrong)]
        if i >= len(wrong):  # variations: wrap in a list, or a random int / string
            base = [base] if i % 3 == 0 else (int(rng.integers(-2**62, 2**62)) if i % 3 == 1
                                              else rng.bytes(5).hex())
        out.append((f"wrong-type-{i}", pack(base)))

    # 5. maps with missing, extra or renamed keys (40)
    for i, key in enumerate(KEYS * 2):
        obj = dict(maps[i // len(KEYS)])
        del obj[key]
        out.append((f"missing-{key}", pack(obj)))
    for i in range(10):
        obj = dict(maps[i % len(maps)])
        obj[["extra", "Format", "tasks2", "", "epsilon "][i % 5]] = [1, None, "x", 0.5, b""][i % 5]
        out.append(("extra-key", pack(obj)))
    for i in range(10):
        obj = dict(maps[i % len(maps)])
        key = KEYS[i]
        obj[key.upper()] = obj.pop(key)
        out.append((f"renamed-{key}", pack(obj)))

    # 6. one field mutated to an invalid value (the rest, 430)
    i = 0
    while len(out) < 1000:
        mutate = MUTATORS[i % len(MUTATORS)]
        obj = mutate(copy.deepcopy(maps[(i // len(MUTATORS)) % len(maps)]), rng)
        i += 1
        if obj is not None:
            out.append((mutate.__name__, pack(obj)))
    assert len(out) == 1000
    return out


MALFORMED = malformed_messages()


def test_exactly_1000_malformed_messages():
    assert len(MALFORMED) == 1000
    labels = {label.split("-")[0] for label, _ in MALFORMED}
    assert {"random", "truncate", "trailing", "wrong", "missing", "extra", "renamed"} <= labels
    assert {m.__name__ for m in MUTATORS} <= labels  # every mutator made it in


def test_malformed_messages_raise_value_error():
    failures = []
    for label, data in MALFORMED:
        try:
            Plan.from_msgpack(data)
        except ValueError:
            continue
        except Exception as exc:  # noqa: BLE001 - any other type is the failure under test
            failures.append((label, f"{type(exc).__name__}: {exc}"))
        else:
            failures.append((label, "accepted"))
    assert not failures, failures[:20]


def test_non_bytes_input():
    for bad in (None, "abc", 5, [1, 2], {"a": 1}, np.zeros(3)):
        with pytest.raises(ValueError, match="bytes"):
            Plan.from_msgpack(bad)


# ---- bit flips ------------------------------------------------------------------------------------
def test_bit_flip_fuzz():
    rng = np.random.default_rng(7)
    base = base_plans()[0]
    data = base.to_msgpack()
    decoded = rejected = 0
    failures = []
    for i in range(1000):
        buf = bytearray(data)
        kind = i % 3
        if kind == 0:  # one bit
            pos = int(rng.integers(len(buf)))
            buf[pos] ^= 1 << int(rng.integers(8))
        elif kind == 1:  # several random bytes
            for pos in rng.integers(len(buf), size=int(rng.integers(2, 9))):
                buf[pos] = int(rng.integers(256))
        else:  # a few bytes inverted
            for pos in rng.integers(len(buf), size=int(rng.integers(1, 4))):
                buf[pos] ^= 0xFF
        try:
            plan = Plan.from_msgpack(bytes(buf))
        except ValueError:
            rejected += 1
            continue
        except Exception as exc:  # noqa: BLE001
            failures.append((i, f"{type(exc).__name__}: {exc}"))
            continue
        decoded += 1
        try:
            again = Plan(doc_lens_per_rank=plan.doc_lens_per_rank, num_servers=plan.num_servers,
                         mode=plan.mode, cost=plan.cost, server_tasks=plan.server_tasks,
                         epsilon=plan.epsilon, min_shard=plan.min_shard,
                         keep_activations=plan.keep_activations)
            assert again == plan
            assert Plan.from_msgpack(plan.to_msgpack()) == plan
        except Exception as exc:  # noqa: BLE001
            failures.append((i, f"decoded plan is broken: {type(exc).__name__}: {exc}"))
    assert not failures, failures[:20]
    assert rejected > 500  # most flips are caught
    assert decoded + rejected == 1000
