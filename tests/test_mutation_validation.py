"""Unit checks of reply validation (flwr_jdp/joint_dp/validation.py) written to kill
surviving mutants (docs/mutation.md): every reason a reply is dropped or zeroed,
at the edge of each check, with the exact reason text, and what is kept (arrays in
spec order, weights, metrics)."""

import math

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp import validation as v
from flwr_jdp.joint_dp.validation import ArraySpec, spec_of, validate_replies

SPEC = {"a": ArraySpec((2,), "float32"), "b": ArraySpec((1, 2), "float32")}


def _arrays(scale=0.1):
    return {"a": np.full(2, scale, dtype=np.float32), "b": np.full((1, 2), scale, dtype=np.float32)}


def _reply(node, content=None, error=None):
    InProcessGrid(None, 0, {})  # the task identity Messages are stamped with
    instruction = Message(RecordDict({protocol.CONFIG: ConfigRecord()}), dst_node_id=node,
                          message_type=MessageType.TRAIN)
    if error is not None:
        return Message(Error(code=1, reason=error), reply_to=instruction)
    return Message(content, reply_to=instruction)


def _content(owners, arrays=None, metrics=None, standard=False):
    content = RecordDict()
    for o in owners:
        arr = arrays(o) if callable(arrays) else (arrays if arrays is not None else _arrays())
        met = metrics(o) if callable(metrics) else (metrics or {protocol.NUM_EXAMPLES: 10 + o})
        if standard:
            content[protocol.ARRAYS] = ArrayRecord({k: Array(x) for k, x in arr.items()})
            content[protocol.METRICS] = MetricRecord(met)
        else:
            content[protocol.owner_key(o)] = ArrayRecord({k: Array(x) for k, x in arr.items()})
            content[protocol.metrics_key(o)] = MetricRecord(met)
    return content


def test_spec_of_lists_shape_and_dtype():
    rec = ArrayRecord({"w": Array(np.zeros((3, 2), dtype=np.float64)), "b": Array(np.zeros(3, dtype=np.float32))})
    assert spec_of(rec) == {"w": ArraySpec((3, 2), "float64"), "b": ArraySpec((3,), "float32")}


def test_decode_arrays_reasons():
    rec = ArrayRecord({k: Array(x) for k, x in _arrays().items()})
    arrays, reason = v.decode_arrays(rec, SPEC)
    assert reason is None and [a.shape for a in arrays] == [(2,), (1, 2)]
    assert v.decode_arrays(ConfigRecord({"x": 1}), SPEC) == (None, "expected an ArrayRecord, got ConfigRecord")
    extra = ArrayRecord({**{k: Array(x) for k, x in _arrays().items()}, "c": Array(np.zeros(1))})
    assert v.decode_arrays(extra, SPEC)[1] == \
        "array keys differ from the shared parameters (extra=['c'], missing=[])"
    missing = ArrayRecord({"a": Array(np.zeros(2, dtype=np.float32))})
    assert v.decode_arrays(missing, SPEC)[1] == \
        "array keys differ from the shared parameters (extra=[], missing=['b'])"
    shape = ArrayRecord({"a": Array(np.zeros(3, dtype=np.float32)), "b": Array(np.zeros((1, 2), dtype=np.float32))})
    assert v.decode_arrays(shape, SPEC) == (None, "array 'a' has shape (3,), expected (2,)")
    dtype = ArrayRecord({"a": Array(np.zeros(2, dtype=np.float64)), "b": Array(np.zeros((1, 2), dtype=np.float32))})
    assert v.decode_arrays(dtype, SPEC) == (None, "array 'a' has dtype float64, expected float32")
    # the second array is checked too (not only the first)
    late = ArrayRecord({"a": Array(np.zeros(2, dtype=np.float32)), "b": Array(np.zeros((2, 1), dtype=np.float32))})
    assert v.decode_arrays(late, SPEC) == (None, "array 'b' has shape (2, 1), expected (1, 2)")


def test_decode_arrays_rejects_bytes_that_do_not_decode():
    good = Array(np.zeros(2, dtype=np.float32))
    bad = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=b"not numpy")
    rec = ArrayRecord({"a": bad, "b": Array(np.zeros((1, 2), dtype=np.float32))})
    arrays, reason = v.decode_arrays(rec, SPEC)
    assert arrays is None and reason.startswith("array 'a' cannot be decoded: ")
    # bytes that decode to another shape than the header claims
    lying = Array(dtype=good.dtype, shape=good.shape, stype=good.stype,
                  data=Array(np.zeros(3, dtype=np.float32)).data)
    rec = ArrayRecord({"a": lying, "b": Array(np.zeros((1, 2), dtype=np.float32))})
    assert v.decode_arrays(rec, SPEC) == (None, "array 'a' decodes to float32(3,), expected float32(2,)")


def test_check_values_edges():
    ok = list(_arrays().values())
    assert v.check_values(ok, SPEC, None) is None
    nan = [np.array([0.0, np.nan], dtype=np.float32), ok[1]]
    assert v.check_values(nan, SPEC, None) == "array 'a' has NaN or Inf values"
    inf = [ok[0], np.array([[np.inf, 0.0]], dtype=np.float32)]
    assert v.check_values(inf, SPEC, 10.0) == "array 'b' has NaN or Inf values"
    norm = v.global_norm_numpy(ok)
    assert v.check_values(ok, SPEC, norm) is None
    assert v.check_values(ok, SPEC, norm / (1 + v.NORM_SLACK) * (1 + 1e-7)) is None
    assert v.check_values(ok, SPEC, norm / (1 + v.NORM_SLACK) * (1 - 1e-4)) == \
        f"update norm {norm:.4g} exceeds the clipping norm {norm / (1 + v.NORM_SLACK) * (1 - 1e-4):.4g}"
    assert v.NORM_SLACK == 1e-3
    rec = ArrayRecord({k: Array(x) for k, x in _arrays().items()})
    assert v.check_arrays(rec, SPEC, norm) is None
    assert v.check_arrays(rec, SPEC, norm / 2) is not None
    assert v.check_arrays(ConfigRecord({}), SPEC, None) == "expected an ArrayRecord, got ConfigRecord"


def test_max_sampled_units_is_the_bernstein_bound():
    assert v.SAMPLE_TAIL == 1e-9
    assert v.max_sampled_units(100, 1.0) == 100 and v.max_sampled_units(100, 2.0) == 100
    assert v.max_sampled_units(0, 0.5) == 0 and v.max_sampled_units(-3, 0.5) == 0
    for n, q, tail in [(1000, 0.01, 1e-9), (10_000, 0.05, 1e-9), (500, 0.2, 1e-3), (1000, 0.001, 1e-30)]:
        mu, log_tail = n * q, math.log(1 / tail)
        t = log_tail / 3 + math.sqrt(log_tail**2 / 9 + 2 * log_tail * mu)
        assert v.max_sampled_units(n, q, tail) == min(n, math.ceil(mu + t))
    assert v.max_sampled_units(1000, 0.01) == v.max_sampled_units(1000, 0.01, 1e-9)
    assert v.max_sampled_units(10, 0.9) == 10  # capped at n
    assert v.max_sampled_units(100.7, 0.0) == math.ceil(2 * math.log(1e9) / 3)  # int(n); mu = 0
    assert v.max_sampled_units(10.7, 0.0) == 10


def test_check_metrics():
    req = (protocol.NUM_EXAMPLES,)
    assert v.check_metrics(ConfigRecord({}), req) == (None, "expected a MetricRecord, got ConfigRecord")
    assert v.check_metrics(MetricRecord({}), req) == (None, "metric 'num-examples' missing or not a number (None)")
    assert v.check_metrics(MetricRecord({protocol.NUM_EXAMPLES: [1.0]}), req)[1] == \
        "metric 'num-examples' missing or not a number ([1.0])"
    assert v.check_metrics(MetricRecord({protocol.NUM_EXAMPLES: -1}), req) == \
        (None, "metric 'num-examples' must be finite and >= 0, got -1")
    assert v.check_metrics(MetricRecord({protocol.NUM_EXAMPLES: math.inf}), req)[0] is None
    assert v.check_metrics(MetricRecord({protocol.NUM_EXAMPLES: math.nan}), req)[0] is None
    out, reason = v.check_metrics(MetricRecord({protocol.NUM_EXAMPLES: 0, "acc": 0.5, "bad": math.nan,
                                                "neg": -2.0, "list": [1.0]}), req)
    assert reason is None and out == {protocol.NUM_EXAMPLES: 0.0, "acc": 0.5, "neg": -2.0}
    assert isinstance(out[protocol.NUM_EXAMPLES], float)
    assert v.check_metrics(MetricRecord({"x": 1}), ()) == ({"x": 1.0}, None)


def test_check_metrics_refuses_a_bool():
    class FakeRecord(MetricRecord):
        def get(self, key, default=None):
            return True

    assert v.check_metrics(FakeRecord({}), (protocol.NUM_EXAMPLES,)) == \
        (None, "metric 'num-examples' missing or not a number (True)")


def test_owner_records_maps_standard_keys_for_one_owner_only():
    content = _content([3], standard=True)
    records = v._owner_records(content, [3])
    assert sorted(records) == sorted([protocol.owner_key(3), protocol.metrics_key(3)])
    two = v._owner_records(_content([3], standard=True), [3, 4])
    assert sorted(two) == sorted([protocol.ARRAYS, protocol.METRICS])
    both = _content([3])
    both[protocol.ARRAYS] = ArrayRecord({k: Array(x) for k, x in _arrays(5.0).items()})
    kept = v._owner_records(both, [3])
    assert protocol.ARRAYS in kept  # a keyed record is not overwritten by the standard one


def test_validate_replies_keeps_valid_owners_in_spec_order_with_weights():
    replies = [_reply(1, _content([2, 3])), _reply(2, _content([5], standard=True))]
    out = validate_replies(replies, {1: [2, 3], 2: [5]}, SPEC, max_norm=1.0)
    assert out.dropped == {} and out.zeroed == {}
    assert sorted(out.arrays) == [2, 3, 5]
    assert [a.shape for a in out.arrays[2]] == [(2,), (1, 2)]
    assert out.weights == {2: 12.0, 3: 13.0, 5: 15.0}
    assert out.metrics[5] == {protocol.NUM_EXAMPLES: 15.0}


def test_validate_replies_drop_reasons():
    requested = {1: [2], 2: [4], 3: [6], 4: [8, 9], 5: [10], 7: [14]}
    replies = [  # each kind of bad reply comes before good ones: none ends the loop
        _reply(6, _content([12])),  # a node not asked: ignored
        _reply(5, _content([10, 11])),  # an owner it was not asked for
        _reply(1, error="boom"),
        _reply(2, _content([4], arrays=_arrays(10.0))),  # norm too large
        _reply(3, _content([6], metrics={protocol.NUM_EXAMPLES: -1})),
        _reply(4, _content([8])),  # owner 9 sends nothing
    ]
    out = validate_replies(replies, requested, SPEC, max_norm=1.0)
    assert out.dropped == {
        2: "node 1 reported an error: boom",
        4: f"owner 4 (node 2): update norm {2 * 10.0:.4g} exceeds the clipping norm 1",
        6: "owner 6 (node 3): metric 'num-examples' must be finite and >= 0, got -1",
        9: "owner 9 (node 4): no array record",
        10: f"node 5 sent unexpected records {sorted([protocol.metrics_key(11), protocol.owner_key(11)])}",
        14: "owner 14: no reply",
    }
    assert sorted(out.arrays) == [8] and sorted(out.metrics) == [8] and 12 not in out.dropped


def test_validate_replies_zero_invalid_values_but_drop_malformed_ones():
    requested = {1: [1], 2: [2], 3: [3]}
    nan = _arrays()
    nan["a"][0] = np.nan
    replies = [_reply(1, _content([1], arrays=_arrays(10.0))), _reply(2, _content([2], arrays=nan)),
               _reply(3, _content([3], arrays={"a": np.zeros(3, dtype=np.float32),
                                              "b": np.zeros((1, 2), dtype=np.float32)}))]
    out = validate_replies(replies, requested, SPEC, max_norm=1.0, zero_invalid=True)
    assert sorted(out.arrays) == [1, 2]
    for o in (1, 2):
        assert [a.dtype for a in out.arrays[o]] == [np.float32, np.float32]
        assert [a.shape for a in out.arrays[o]] == [(2,), (1, 2)]
        assert not any(a.any() for a in out.arrays[o])
        assert out.weights[o] == 10.0 + o
    assert out.zeroed == {1: "owner 1 (node 1): update norm 20 exceeds the clipping norm 1",
                          2: "owner 2 (node 2): array 'a' has NaN or Inf values"}
    assert out.dropped == {3: "owner 3 (node 3): array 'a' has shape (3,), expected (2,)"}
    # a zeroed owner whose metrics are bad is dropped, not zeroed
    bad = validate_replies([_reply(1, _content([1], arrays=_arrays(10.0), metrics={"x": 1}))],
                           {1: [1]}, SPEC, max_norm=1.0, zero_invalid=True)
    assert 1 in bad.dropped and bad.zeroed == {} and bad.arrays == {}


def test_validate_replies_metrics_only_and_custom_required_metrics():
    content = RecordDict({protocol.metrics_key(1): MetricRecord({"acc": 0.5})})
    out = validate_replies([_reply(1, content)], {1: [1]}, None, required_metrics=("acc",))
    assert out.metrics == {1: {"acc": 0.5}} and out.arrays == {} and out.weights == {1: 1.0}
    arrays_sent = _content([1])
    out = validate_replies([_reply(1, arrays_sent)], {1: [1]}, None)
    assert out.dropped == {1: f"node 1 sent unexpected records {[protocol.owner_key(1)]}"}
    out = validate_replies([_reply(1, content)], {1: [1]}, None)
    assert out.dropped == {1: "owner 1 (node 1): metric 'num-examples' missing or not a number (None)"}
