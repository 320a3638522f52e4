"""Nothing but the release leaves the node: a ClientApp mod on every outgoing reply.

The client halves (:class:`~flwr_jdp.joint_dp.client.JointDPClient`,
:class:`~flwr_jdp.mtl.client.MTLClient`) put a :class:`ReplyGuard` first on the
user's ClientApp (outermost: outside Flower's SecAgg+ mod and
:func:`~flwr_jdp.joint_dp.client.owners_mod`, so it sees the reply exactly as it
leaves), and around any handler the app registered before them. Whatever the user's
handlers return, a reply leaves the node with only:

- train: the release and its count, as the client half builds them
  (:meth:`ReplyGuard.train_rules`: e.g. per owner an ArrayRecord with exactly the
  shared parameter names and shapes of the broadcast, none a personal one, and a
  MetricRecord with ``num-examples`` only);
- evaluate: MetricRecords of numbers (no ArrayRecord, no ConfigRecord, no list); a
  client half's ``admit`` (:class:`~flwr_jdp.joint_dp.client.JointDPClient`: the
  node's policy) answers an evaluate message of a run it refuses with an error reply,
  before the app's handler runs;
- set-up (query): the set-up record with the set-up fields only;
- a SecAgg+ stage (train messages carrying Flower's ``secaggplus_configs``):
  Flower's records as its mod and :func:`~flwr_jdp.joint_dp.distributed.secure_sum_mod`
  build them (the masked vector travels inside Flower's record; the arrays emptied).
  The train check also runs inside ``secure_sum_mod`` (:meth:`ReplyGuard.train_only`),
  so what it sums is the release records only and the node stays in the secure sum.

Anything else is removed on the node, with one log line naming what (record and key
names, never values); the rest of the reply is sent unchanged. An evaluate reply
that also carried arrays keeps its metrics: the removed records never leave, so
withholding the metrics too would protect nothing and would lose the owner's
evaluation every round (the same code does the same each round). A train reply whose
release record is not exactly the release's names and shapes loses that record (it
is not a release); the server then drops the owner for the round ("no array record").
An honest reply passes as the same object, bit for bit. Error replies pass as they
are (the client halves put no data in a reason).

What it cannot see: values under a legitimate name. A handler that bypasses the
client half and returns its own un-noised shared parameters under the release's
names and shapes is not detected here (use the client half's ``train``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import WARNING

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.client.mod.utils import make_ffn
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS


@dataclass(frozen=True)
class Allowed:
    """One record a reply may carry: its type and either its keys (``keys``; ``None``:
    any key) or, for an ArrayRecord, exactly these names with these shapes."""

    kind: type
    keys: frozenset[str] | None = None
    shapes: Mapping[str, tuple[int, ...]] | None = None


Rules = dict[str, Allowed]
RuleFn = Callable[[Message, Context], Rules]
#: ``(message, context) -> why the run is refused, or None``.
AdmitFn = Callable[[Message, Context], str | None]

_ANY_CONFIG = Allowed(ConfigRecord)

#: What Flower's SecAgg+ mod replies at each stage (its configs; at the collect stage
#: also the FitRes records :func:`~flwr_jdp.joint_dp.distributed.secure_sum_mod` built,
#: its arrays emptied once masked).
SECAGG_RULES: Rules = {
    RECORD_KEY_CONFIGS: _ANY_CONFIG,
    "fitres.status": Allowed(ConfigRecord, frozenset({"code", "message"})),
    "fitres.metrics": Allowed(ConfigRecord, frozenset()),
    "fitres.num_examples": Allowed(MetricRecord, frozenset({"num_examples"})),
    "fitres.parameters": Allowed(ArrayRecord, shapes={}),
}


def _number(value: object) -> bool:
    """A metric value that is one number (a list could carry a parameter vector)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(names: list[str], limit: int = 10) -> str:
    return f"{names[:limit]}{'...' if len(names) > limit else ''}"


def filter_content(content: RecordDict, rules: Rules | None) -> tuple[RecordDict, list[str]]:
    """``content`` with only what ``rules`` allow (``None``: any MetricRecord of numbers,
    the rule of an evaluate reply), and what was removed, by name. ``content`` itself
    if nothing was removed; records are never modified in place (a record may be the
    app's own object, e.g. in ``context.state``)."""
    out, dropped = RecordDict(), []
    for name, record in content.items():
        rule = rules.get(name) if rules is not None else Allowed(MetricRecord)
        kind = type(record).__name__
        if rule is None or not isinstance(record, rule.kind):
            dropped.append(f"{kind} '{name}'")
            continue
        if isinstance(record, ArrayRecord):
            want = rule.shapes or {}
            have = {k: tuple(a.shape) for k, a in record.items()}
            if have != {k: tuple(s) for k, s in want.items()}:
                odd = sorted(k for k in have if k not in want or have[k] != tuple(want[k]))
                missing = sorted(set(want) - set(have))
                dropped.append(f"{kind} '{name}' (not the release: names or shapes {_shown(odd)}"
                               f"{f', missing {_shown(missing)}' if missing else ''})")
                continue
            out[name] = record
            continue
        numbers = isinstance(record, MetricRecord)
        bad = [k for k, v in record.items()
               if (rule.keys is not None and k not in rule.keys) or (numbers and not _number(v))]
        if bad:
            dropped.append(f"{kind} '{name}' keys {_shown(sorted(bad))}")
            kept = {k: v for k, v in record.items() if k not in bad}
            out[name] = type(record)(kept)
        else:
            out[name] = record
    return (content, []) if not dropped else (out, dropped)


class ReplyGuard:
    """A ClientApp mod: every reply leaves the node with only what the rules allow.

    Parameters
    ----------
    train_rules : callable
        ``(instruction, context) -> {record name: Allowed}``: what a train reply to
        ``instruction`` may carry (the release and its count).
    setup_rules : dict
        What a set-up (query) reply may carry.
    name : str
        How the log line names the client half.
    admit : callable, optional
        ``(message, context) -> reason or None``: why the run of an evaluate message is
        refused (the reason is the error reply; the handler does not run).
    """

    def __init__(self, train_rules: RuleFn, setup_rules: Rules, name: str, admit: AdmitFn | None = None) -> None:
        self.train_rules = train_rules
        self.setup_rules = setup_rules
        self.name = name
        self.admit = admit
        self.__name__ = f"reply_guard({name})"

    def rules(self, msg: Message, context: Context) -> Rules | None:
        """What a reply to ``msg`` may carry (``None``: MetricRecords of numbers)."""
        kind = msg.metadata.message_type.split(".")[0]
        if kind == MessageType.TRAIN:
            if RECORD_KEY_CONFIGS in msg.content.config_records:
                return SECAGG_RULES
            return self._train(msg, context)
        if kind == MessageType.EVALUATE:
            return None
        if kind == MessageType.QUERY:
            return self.setup_rules
        return {}

    def _train(self, msg: Message, context: Context) -> Rules:
        try:
            return self.train_rules(msg, context)
        except Exception as err:  # noqa: BLE001 - a malformed instruction: nothing may leave
            log(WARNING, "%s: cannot read what the train reply may carry (%s: %s); it leaves empty",
                self.__name__, type(err).__name__, err)
            return {}

    def _filtered(self, msg: Message, reply: Message, rules: Rules | None) -> Message:
        content, dropped = filter_content(reply.content, rules)
        if dropped:
            log(WARNING, "%s: dropped from the %s reply before it left the node (only the release and its count, "
                "evaluation metrics or set-up fields may leave): %s", self.__name__,
                msg.metadata.message_type, "; ".join(dropped))
            reply.content = content
        return reply

    def __call__(self, msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        if self.admit is not None and msg.metadata.message_type.split(".")[0] == MessageType.EVALUATE:
            reason = self.admit(msg, context)
            if reason:
                return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)
        reply = call_next(msg, context)
        return reply if reply.has_error() else self._filtered(msg, reply, self.rules(msg, context))

    def train_only(self, msg: Message, context: Context,
                   call_next: Callable[[Message, Context], Message]) -> Message:
        """The same check of train replies, for a place inside a mod that consumes them
        (:func:`~flwr_jdp.joint_dp.distributed.secure_sum_mod`, which sums the release
        records before SecAgg+ masks the sum): the handlers' extra records are removed
        there and the node stays in the secure sum. Other messages pass."""
        reply = call_next(msg, context)
        if reply.has_error() or msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:
            return reply
        return self._filtered(msg, reply, self._train(msg, context))


def install(app: ClientApp, guard: ReplyGuard, *inner: Callable) -> None:
    """Put ``guard`` first on ``app``'s mods, ``inner`` mods right after it (each once),
    and around every handler the app registered before: outermost, it sees each reply
    as it leaves. ``inner`` may hold ``guard.train_only`` after a mod that consumes
    the handlers' train replies."""
    mods = getattr(app, "_mods", None)
    if not isinstance(mods, list):
        raise TypeError("the ClientApp has no mod list (a ClientApp built with client_fn?): "
                        "use ClientApp() with @app.train() / @app.evaluate() handlers")
    for mod in reversed((guard, *inner)):
        if mod in mods:
            mods.remove(mod)
        mods.insert(0, mod)
    registered = getattr(app, "_registered_funcs", {})
    for name, fn in list(registered.items()):
        registered[name] = make_ffn(fn, [guard])


__all__ = ["SECAGG_RULES", "AdmitFn", "Allowed", "ReplyGuard", "Rules", "filter_content", "install"]
