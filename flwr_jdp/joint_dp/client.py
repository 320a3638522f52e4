"""The client half of joint DP for a user's own Flower ClientApp.

The user keeps their ClientApp, model class, data loaders, loss, optimizer and
their ``train`` / ``test`` functions. One line registers flwr-jdp's set-up
exchange on the app; the train handler hands its model, loader and train function
to :meth:`JointDPClient.train`; the evaluate handler loads the owner's model with
:meth:`JointDPClient.load` instead of ``load_state_dict``::

    app = ClientApp()
    jdp = JointDPClient(app, model_fn=Net, train_data=lambda ctx: load_data(ctx)[0])

    @app.train()
    def train(msg, context):
        trainloader, _ = load_data(context)
        return jdp.train(msg, context, Net(), trainloader,
                         lambda net, loader: train_fn(net, loader, epochs, lr, device))

    @app.evaluate()
    def evaluate(msg, context):
        model = jdp.load(Net(), msg, context)
        ...  # the app's own test and reply

What :meth:`JointDPClient.train` does for one owner (the node's ``partition-id``),
under the run config's ``jdp.*`` keys (:func:`flwr_jdp.joint_dp.config.namespaced_config`):

1. Under local noise it checks the server's instruction against what the owner
   agreed to and charges the owner's own ledger before touching data
   (:mod:`flwr_jdp.joint_dp.owner_guard`); a refused instruction gets an error
   reply naming the reason and nothing is trained or sent.
2. The model gets the broadcast shared parameters and the owner's personal
   parameters (``context.state``, or the public initial values the server sent at
   set-up). Personal parameters are those whose names match ``jdp.personal-layers``.
3. Record or user unit (the decoupled coupling): the personal parameters are fitted
   on the broadcast by the user's ``train_fn`` on the user's loader with the shared
   parameters frozen (a function of public DP output and the owner's own data); the
   release is then computed with the personal parameters at their public values and
   frozen: ``train_fn`` runs on a Poisson loader at exactly the server's sampling
   rate and step count, and every optimizer step applies the clipped, noised
   gradient (:mod:`flwr_jdp.training.dp_pass`). Central noise: one Poisson batch's
   clipped per-unit gradient sum is the release (the server adds the noise).
   Distributed noise: the same pass, each unit's clipped gradient rounded to integers
   and the owner's Skellam share added (:mod:`flwr_jdp.joint_dp.distributed`); the
   reply goes through Flower's SecAgg+ client mod, which :class:`JointDPClient`
   puts first on the app.
4. Owner unit: ``train_fn`` trains every parameter; the release is the shared
   update clipped to ``C`` (plus ``N(0, (z C)^2)`` under local noise).
5. The reply carries ``arrays`` (the shared release only; never a personal value)
   and ``metrics`` (``num-examples``, the public data size). The user's training
   loss is not sent: it is not covered by the guarantee.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from logging import ERROR, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode
from torch import nn
from torch.utils.data import DataLoader

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import NAMESPACE, ConfigError, JobConfig, namespaced_config
from flwr_jdp.joint_dp.distributed import UnitEncoder, charge_distributed, encode_release, secure_sum_mod
from flwr_jdp.joint_dp.hosting import hosting_mod, owners_mod  # noqa: F401 - re-exported
from flwr_jdp.joint_dp.owner_guard import Instruction, InstructionRefused, owner_policy
from flwr_jdp.joint_dp.owner_store import (
    charge_owners,
    load_personal_arrays,
    owner_generator,
    personal_fit_on,
    read_instructions,
    save_personal_arrays,
    shared_arrays,
    shared_digest,
)
from flwr_jdp.joint_dp.release import public_personal_swapped
from flwr_jdp.joint_dp.reply_rules import joint_dp_guard
from flwr_jdp.joint_dp.schedule import OwnerSize
from flwr_jdp.joint_dp.secure_sum import inside_secure_sum
from flwr_jdp.params import ParamSplit, get_arrays, set_arrays, split_parameters
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, clip_numpy, numpy_rng
from flwr_jdp.privacy.units import NoisePlacement, PrivacyUnit
from flwr_jdp.reply_guard import ReplyGuard, install
from flwr_jdp.training.dp_pass import LossFn, Plan, UserLoopError, dry_run, private_training

TrainFn = Callable[[nn.Module, DataLoader], object]

#: What a message lacking flwr-jdp's records most likely means.
NOT_JOINT_DP = ("is the ServerApp flwr-jdp's? Start flwr-jdp's JointDP strategy in place of "
                "FedAvg: a FedAvg ServerApp sends no flwr-jdp instruction, and nothing is trained or sent")

#: ``context.state`` key of the public initial personal values (from the server's set-up).
PUBLIC_KEY = "jdp.public-personal"
#: ``context.state`` key (``.<owner>``) of a rule of the DP pass the train function broke.
REFUSED_KEY = "jdp.refused"


def owner_id(context: Context) -> int:
    """The owner a node hosts: its ``partition-id`` (node config), else its node id."""
    pid = context.node_config.get("partition-id")
    return int(pid) if pid is not None else int(context.node_id)


def _spec_of(model: nn.Module) -> tuple[list[str], list[str]]:
    names, shapes = [], []
    for n, p in model.named_parameters():
        names.append(n)
        shapes.append("x".join(str(d) for d in p.shape) or "scalar")
    return names, shapes


class JointDPClient:
    """Registers the set-up exchange on ``app`` and trains owners under joint DP.

    Parameters
    ----------
    app : ClientApp
        The user's ClientApp; a ``query`` handler for the set-up is added to it.
    model_fn : callable
        ``() -> nn.Module``, the user's model class (its parameter names and shapes
        are reported at set-up, so the server checks its ``initial_arrays`` before
        any privacy is spent); ``(context) -> nn.Module`` if it has a required
        positional parameter (a model built from the run config).
    train_data : callable
        ``(context) -> DataLoader``, the owner's training loader; its data set's size
        is reported at set-up (public metadata, as in every DP-SGD deployment).
    user_ids : callable, optional
        ``(context) -> sequence of int``, the user of every record of the training
        data set (``jdp.privacy-unit = "user"``).
    config_fn : callable, optional
        ``(context) -> JobConfig``; default: the run config's ``jdp.*`` keys
        (:func:`~flwr_jdp.joint_dp.config.namespaced_config`). flwr-jdp's own app,
        whose whole run config is flwr-jdp's, reads its flat keys.
    """

    def __init__(self, app: ClientApp, *, model_fn: Callable[..., nn.Module],
                 train_data: Callable[[Context], DataLoader],
                 user_ids: Callable[[Context], Sequence[int]] | None = None,
                 config_fn: Callable[[Context], JobConfig] | None = None) -> None:
        self.model_fn = model_fn
        self.train_data = train_data
        self.user_ids = user_ids
        self.config_fn = config_fn or (lambda context: namespaced_config(context.run_config))
        self._key_prefix = "" if config_fn else f"{NAMESPACE}."  # how the user spells the keys
        _add_mods(app, joint_dp_guard(lambda context: self.config(context).effective_personal_rule,
                                      admit=self._admit, secure_only=lambda context: _secure_only(self.config(context))))
        app.query()(self._setup)

    # ------------------------------------------------------------------ set-up
    def config(self, context: Context) -> JobConfig:
        """The run config (validated; ``jdp.*`` keys unless ``config_fn`` says otherwise)."""
        cfg = self.config_fn(context)
        if cfg.personal_coupling != "decoupled":
            raise ConfigError(f"run-config key '{self._key_prefix}personal-coupling' must be 'decoupled': the interleaved "
                              "coupling (the joint-DP paper's Algorithm 1) trains the release through "
                              "personal parameters fitted without noise, which voids the guarantee")
        return cfg

    def _units(self, cfg: JobConfig, context: Context, num_records: int) -> tuple[torch.Tensor, int]:
        if cfg.unit is not PrivacyUnit.USER:
            return torch.arange(num_records), num_records
        if self.user_ids is None:
            raise ConfigError(f"run-config key '{self._key_prefix}privacy-unit'='user' needs "
                              "JointDPClient(user_ids=...)")
        ids = np.asarray(list(self.user_ids(context)))
        if len(ids) != num_records:
            raise ConfigError(f"user_ids gave {len(ids)} ids for {num_records} training records")
        _, inverse = np.unique(ids, return_inverse=True)
        return torch.from_numpy(inverse.astype(np.int64)), int(inverse.max()) + 1 if len(ids) else 0

    def _size(self, cfg: JobConfig, context: Context, loader: DataLoader) -> OwnerSize:
        n = len(loader.dataset)  # type: ignore[arg-type]
        if n == 0:
            raise ConfigError(f"owner {owner_id(context)}: the training data set is empty")
        _, users = self._units(cfg, context, n)
        return OwnerSize(n, users)

    def _setup(self, msg: Message, context: Context) -> Message:
        """Hold the run to the node's policy (:func:`~flwr_jdp.joint_dp.owner_guard.owner_policy`:
        an error reply naming the run-config key and the policy's value if it breaks it),
        then report this node's owner, its data size, its policy's cap (``max-epsilon``)
        and the model's parameter names and shapes; keep the public initial personal
        values the server sent."""
        try:
            cfg = self.config(context)
            cap = owner_policy(context, cfg).max_epsilon
            size = self._size(cfg, context, self.train_data(context))
            try:
                model = self._model(context)
            except TypeError as err:
                raise ConfigError(f"model_fn could not build the model ({err}): pass a callable taking no "
                                  "argument, or the Context (e.g. lambda: Net(num_classes=10))") from None
            self._check_buffers(cfg, model)
            names, shapes = _spec_of(model)
        except InstructionRefused as err:
            log(WARNING, "Refused the run at set-up: %s", err)
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"refused: {err}"), reply_to=msg)
        except (ConfigError, UserLoopError, ValueError) as err:
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(err)), reply_to=msg)
        public = msg.content.get(protocol.PUBLIC_PERSONAL)
        if isinstance(public, ArrayRecord):
            context.state[PUBLIC_KEY] = public
        rec = ConfigRecord({
            protocol.OWNER_IDS: [owner_id(context)],
            protocol.NUM_RECORDS: [size.num_records],
            protocol.NUM_USERS: [size.num_users],
            protocol.MAX_EPSILON: [cap or 0.0],
            protocol.PARAM_NAMES: names,
            protocol.PARAM_SHAPES: shapes,
        })
        return Message(RecordDict({protocol.SETUP: rec}), reply_to=msg)

    def _admit(self, msg: Message, context: Context) -> str | None:
        """Why the node refuses an evaluate message's run (its policy, as at set-up and
        train: :func:`~flwr_jdp.joint_dp.owner_guard.owner_policy`), or None; the reply
        guard answers a refused one with this reason before the app's handler runs."""
        try:
            owner_policy(context, self.config(context))
        except InstructionRefused as err:
            log(WARNING, "Refused the evaluate message (no metrics sent): %s", err)
            return f"refused: {err}"
        except ConfigError as err:
            return str(err)
        return None

    # ------------------------------------------------------------------- model
    def _model(self, context: Context) -> nn.Module:
        """``model_fn(context)`` if it has a required positional parameter, else
        ``model_fn()`` (a model class whose arguments all have defaults)."""
        try:
            takes_context = any(p.default is inspect.Parameter.empty and p.kind in (
                inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                for p in inspect.signature(self.model_fn).parameters.values())
        except (TypeError, ValueError):  # a builtin or C callable: called without arguments
            takes_context = False
        return self.model_fn(context) if takes_context else self.model_fn()

    @staticmethod
    def _check_buffers(cfg: JobConfig, model: nn.Module) -> None:
        """BatchNorm is refused (record or user unit): it mixes the records of a batch and
        keeps running statistics of the data. Other buffers are fine as long as the forward
        pass leaves them as they are (position ids, token type ids): the DP pass's dry run
        refuses one that changes them (:func:`~flwr_jdp.training.dp_pass.dry_run`)."""
        norms = [type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]  # noqa: SLF001
        if norms and cfg.dp and cfg.unit is not PrivacyUnit.OWNER:
            raise UserLoopError(f"the model has {norms[0]}, which mixes the records of a batch; replace it by "
                                "GroupNorm or LayerNorm, e.g. in one call: from opacus.validators import "
                                "ModuleValidator; model = ModuleValidator.fix(model) (in model_fn and in train)")

    def _split(self, cfg: JobConfig, model: nn.Module) -> ParamSplit:
        try:
            return split_parameters(model, cfg.effective_personal_rule, allow_empty=cfg.method != "joint-dp")
        except ValueError as err:
            raise ConfigError(f"run-config key '{self._key_prefix}personal-layers': {err}") from None

    def _public(self, context: Context, split: ParamSplit) -> dict[str, np.ndarray]:
        if not split.personal:
            return {}
        rec = context.state.get(PUBLIC_KEY)
        if not isinstance(rec, ArrayRecord):
            raise UserLoopError("the public initial personal values from the set-up are missing "
                                "(the node restarted after the set-up?): restart the run")
        values = dict(zip(rec.keys(), rec.to_numpy_ndarrays(), strict=True))
        missing = set(split.personal) - set(values)
        if missing:
            raise UserLoopError(f"the set-up sent no initial values for personal parameters {sorted(missing)}")
        return {n: values[n] for n in split.personal}

    def _load(self, cfg: JobConfig, model: nn.Module, msg: Message, context: Context,
              session: str) -> tuple[ParamSplit, dict[str, np.ndarray]]:
        split = self._split(cfg, model)
        shared = shared_arrays(msg.content.get(protocol.SHARED))
        if set(shared) != set(split.shared):
            extra, missing = sorted(set(shared) - set(split.shared)), sorted(set(split.shared) - set(shared))
            raise UserLoopError(f"the broadcast does not match this model's shared parameters "
                                f"(unknown: {extra[:5]}, missing: {missing[:5]})")
        self._check_buffers(cfg, model)
        personal = load_personal_arrays(context, owner_id(context), session)
        set_arrays(model, personal if personal is not None else self._public(context, split))
        set_arrays(model, shared)
        return split, shared

    def load(self, model: nn.Module, msg: Message, context: Context,
             fit: Callable[[nn.Module], object] | None = None) -> nn.Module:
        """``model`` with the broadcast shared parameters of ``msg`` and this owner's
        personal parameters (for evaluation; replaces ``load_state_dict``).

        With ``fit`` (``model -> anything``, e.g. ``lambda m: train_fn(m, trainloader,
        ...)``) the personal parameters are first fitted on this broadcast, shared
        parameters frozen, if they have not been yet (no privacy cost: nothing it
        computes is sent); without it they are those of the last train round. A run
        the node's policy refuses raises :class:`InstructionRefused` (the reply guard
        has answered its evaluate messages with an error already)."""
        cfg = self.config(context)
        owner_policy(context, cfg)
        cfg_rec = msg.content.get(protocol.CONFIG)
        if not isinstance(cfg_rec, ConfigRecord):
            raise ConfigError(f"the evaluate message has no '{protocol.CONFIG}' record: {NOT_JOINT_DP}")
        session = str(cfg_rec.get(protocol.SESSION, ""))
        split, shared = self._load(cfg, model, msg, context, session)
        o = owner_id(context)
        digest = shared_digest(shared)
        if (fit is not None and cfg.decoupled and split.personal
                and personal_fit_on(context, o, session) != digest):
            self._fit_personal(model, split, fit)
            save_personal_arrays(context, o, dict(get_arrays(model, split.personal)), session,
                                 fit_on=digest, count_round=False)
        return model

    def _release_model(self, context: Context, model: nn.Module, split: ParamSplit, shared: dict[str, np.ndarray],
                       public: dict[str, np.ndarray]) -> nn.Module:
        """A fresh model (``model_fn``; else a copy of ``model`` taken before any of the
        user's code ran this round) holding the broadcast and the public personal values,
        personal parameters frozen: the DP steps run on it, never on the model the
        user's code has touched (its attributes, hooks, modes)."""
        import copy

        spec = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        try:
            release = self._model(context)
        except Exception:  # noqa: BLE001 - model_fn was checked at set-up; a copy does as well
            release = None
        if release is None or [(n, tuple(p.shape)) for n, p in release.named_parameters()] != spec:
            release = copy.deepcopy(model)
        set_arrays(release, {**shared, **public})
        for n, p in release.named_parameters():
            p.requires_grad_(n in split.shared)
        return release

    @staticmethod
    def _fit_personal(model: nn.Module, split: ParamSplit, fit: Callable[[nn.Module], object]) -> None:
        """``fit(model)`` on the owner's own data, shared parameters frozen. Whatever the data
        does there (an exception, non-finite values) the round goes on with the previous
        personal values, logged on the node only: whether the owner replies must not
        depend on its data."""
        params = dict(model.named_parameters())
        flags = {n: p.requires_grad for n, p in params.items()}
        before = {n: params[n].detach().clone() for n in split.personal}
        raised = None
        try:
            for n in split.shared:
                params[n].requires_grad_(False)
            fit(model)
        except Exception as err:  # noqa: BLE001 - the user's code on the owner's data; its message stays here
            raised = f"raised {type(err).__name__}: {err}"
        finally:
            for n, p in params.items():
                p.requires_grad_(flags[n])
                p.grad = None  # nothing of the fit carries into the release's steps
        bad = [n for n in split.personal if not torch.isfinite(params[n]).all()]
        if raised or bad:  # kept local, whatever the data: the round goes on with the previous values
            log(WARNING, "The personal fit %s; the previous personal values are kept", raised or
                f"made {bad[:3]} non-finite (a non-finite record or a diverging loss?)")
            with torch.no_grad():
                for n in split.personal:
                    params[n].copy_(before[n])

    # ------------------------------------------------------------------- train
    def train(self, msg: Message, context: Context, model: nn.Module, train_loader: DataLoader,
              train_fn: TrainFn, *, loss_fn: LossFn | None = None) -> Message:
        """Train this node's owner for one round with the user's ``train_fn(model,
        loader)`` and return the reply (shared release only). A refused instruction
        or an error the user can act on becomes an error reply naming the cause.

        ``loss_fn(model, batch) -> scalar tensor`` (optional): the loss of ``batch``, exactly
        as the loader yields it, under ``model``, as ``train_fn`` computes it (e.g.
        ``lambda net, b: F.cross_entropy(net(b[0]), b[1])``, ``lambda net, b: net(**b).loss``).
        With it, ``train_fn`` gets the model itself (its class unchanged: a
        ``LightningModule`` stays one) and the DP steps use each record's gradient of
        ``loss_fn`` on that record alone, so any outputs, keyword inputs and loss work;
        ``optimizer.step(closure)`` is accepted. Without it, the loss must be a torch loss
        on the model's output (docs/dropin.md)."""
        try:
            return self._train(msg, context, model, train_loader, train_fn, loss_fn)
        except InstructionRefused as err:
            log(WARNING, "Refused the train instruction (nothing trained or sent): %s", err)
            reason = f"refused: {err}"
        except (ConfigError, UserLoopError) as err:
            log(WARNING, "Train round failed (nothing sent): %s", err)
            reason = f"{protocol.BROKEN_RULE}: {err}" if getattr(err, "structural", False) else str(err)
        except Exception as err:  # noqa: BLE001 - the user's code: its message may hold data
            log(ERROR, "Train round failed (nothing sent): %s: %s", type(err).__name__, err)
            reason = f"the train round raised {type(err).__name__} (its message is in the node's log, not sent)"
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)

    def _train(self, msg: Message, context: Context, model: nn.Module, loader: DataLoader,
               train_fn: TrainFn, loss_fn: LossFn | None = None) -> Message:
        cfg = self.config(context)
        if _secure_only(cfg) and not inside_secure_sum():
            # the owner adds only a share of the noise its ledger charges: its vector may leave only masked
            raise InstructionRefused("noise-placement='distributed' releases only inside the secure sum (SecAgg+ "
                                     "with flwr-jdp's checks); this train message came outside it (no SecAgg+ "
                                     "collect stage): the owner's noise share alone would reach the server")
        cfg_rec = msg.content.get(protocol.CONFIG)
        if not isinstance(cfg_rec, ConfigRecord):
            raise InstructionRefused(f"the train instruction has no '{protocol.CONFIG}' record: {NOT_JOINT_DP}")
        session = str(cfg_rec.get(protocol.SESSION, ""))
        o = owner_id(context)
        size = self._size(cfg, context, loader)
        instruction = read_instructions(cfg, cfg_rec, [o])[o]
        refused = context.state.get(f"{REFUSED_KEY}.{o}")
        if isinstance(refused, ConfigRecord):  # the same code would break the same rule: spend nothing
            raise UserLoopError(f"{refused['reason']} (in an earlier round of this run: fix it and start a new "
                                "run)", structural=True)
        owner_policy(context, cfg)  # the node's policy first: a run it refuses runs none of the user's code
        central = cfg.placement is not NoisePlacement.LOCAL  # one clipped sum, noised by others
        plan = self._dry_run(cfg, context, model, loader, train_fn, loss_fn, central)
        charge_owners(cfg, context, {o: size}, {o: instruction}, session)  # local; central under a policy
        split, shared = self._load(cfg, model, msg, context, session)
        release_model = (self._release_model(context, model, split, shared, self._public(context, split))
                         if cfg.dp and cfg.unit is not PrivacyUnit.OWNER else None)
        generator = owner_generator(cfg, instruction.server_round, o)
        digest = shared_digest(shared)
        if not cfg.dp:  # the FedAvg and per-silo baselines: no noise, every parameter trained
            train_fn(model, loader)
            release = dict(get_arrays(model, split.shared))
        elif cfg.unit is PrivacyUnit.OWNER:
            release = self._owner_release(cfg, model, split, loader, train_fn, instruction.noise_multiplier,
                                          generator)
        else:
            # distributed noise: checked and charged before any of the owner's data is read
            encoder = (self._encoder(cfg, context, cfg_rec, o, model, split, instruction, generator, session)
                       if cfg.placement is NoisePlacement.DISTRIBUTED else None)
            if split.personal and personal_fit_on(context, o, session) != digest:
                self._fit_personal(model, split, lambda m: train_fn(m, loader))
                set_arrays(model, shared)  # the release starts from the broadcast, whatever the fit did
            unit_of_record, num_units = self._units(cfg, context, size.num_records)
            public = self._public(context, split)
            try:
                with public_personal_swapped(model, split, public) as m, \
                        private_training(m, loader, unit_of_record=unit_of_record, num_units=num_units,
                                         sample_rate=instruction.sample_rate,
                                         steps=1 if central else instruction.steps,
                                         noise_multiplier=instruction.noise_multiplier,
                                         clipping_norm=cfg.clipping_norm, generator=generator,
                                         secure=cfg.secure_noise, capture=central,
                                         epochs=1 if central else cfg.local_epochs, train_fn=train_fn,
                                         release_model=release_model, unit_encoder=encoder,
                                         plan=plan) as (private, ploader, record):
                    _run_user_code(train_fn, private, ploader)
            except UserLoopError as err:
                if err.structural:  # the same code breaks the same rule next round: charge nothing more
                    context.state[f"{REFUSED_KEY}.{o}"] = ConfigRecord({"reason": str(err)})
                raise
            if not central:  # the trainable (shared) parameters as the last DP step left them
                release = {n: record.release[n].detach().cpu().numpy() for n in split.shared}
            elif encoder is not None:  # the integer sum plus this owner's noise share, as field elements
                sums = record.clipped_sum or [torch.zeros(p.shape, dtype=torch.float64)
                                              for n, p in model.named_parameters() if n in split.shared]
                fields = encode_release([t.detach().cpu().numpy() for t in sums], encoder.plan, encoder.rng)
                release = dict(zip(split.shared, fields, strict=True))
            else:  # the clipped sum is in ``record`` once private_training has closed
                sums = record.clipped_sum or [torch.zeros_like(p) for n, p in model.named_parameters()
                                              if n in split.shared]
                release = {n: s.detach().cpu().numpy().astype(np.float32)
                           for n, s in zip(split.shared, sums, strict=True)}
        bad = [n for n, a in release.items() if not np.all(np.isfinite(a))]
        if bad:
            raise UserLoopError(f"the release has non-finite values in {bad[:3]} (a non-finite loss or "
                                "learning rate?)")
        save_personal_arrays(context, o, dict(get_arrays(model, split.personal)), session, fit_on=digest)
        dtype = {n: p.detach().cpu().numpy().dtype for n, p in model.named_parameters()}
        if cfg.dp and cfg.placement is NoisePlacement.DISTRIBUTED and cfg.unit is not PrivacyUnit.OWNER:
            dtype = {n: np.dtype(np.int64) for n in split.shared}  # field elements, summed by SecAgg+
        reply = RecordDict({
            "arrays": protocol.to_record({n: release[n].astype(dtype[n]) for n in split.shared}),
            "metrics": MetricRecord({protocol.NUM_EXAMPLES: size.num_records}),
        })
        return Message(reply, reply_to=msg)

    def _dry_run(self, cfg: JobConfig, context: Context, model: nn.Module, loader: DataLoader, train_fn: TrainFn,
                 loss_fn: LossFn | None, central: bool) -> Plan | None:
        """The DP pass's dry run (record or user unit), before the owner is charged and before
        any of its data is read: a rule broken there refuses the round at no cost, and is
        remembered (the same code breaks it again). It runs on copies of ``model`` (made by
        :func:`~flwr_jdp.training.dp_pass.dry_run`) whose personal parameters are frozen, as
        in the DP pass; ``model``'s own flags are put back."""
        if not cfg.dp or cfg.unit is PrivacyUnit.OWNER:
            return None
        split = self._split(cfg, model)
        params = list(model.named_parameters())
        flags = [p.requires_grad for _, p in params]
        try:
            for n, p in params:
                p.requires_grad_(n in split.shared)
            return dry_run(model, loader, train_fn, capture=central, loss_fn=loss_fn)
        except UserLoopError as err:
            if err.structural:
                context.state[f"{REFUSED_KEY}.{owner_id(context)}"] = ConfigRecord({"reason": str(err)})
            raise
        finally:
            for (_, p), flag in zip(params, flags, strict=True):
                p.requires_grad_(flag)

    @staticmethod
    def _encoder(cfg: JobConfig, context: Context, cfg_rec: ConfigRecord, owner: int, model: nn.Module,
                 split: ParamSplit, instruction: Instruction, generator: torch.Generator,
                 session: str) -> UnitEncoder:
        """Distributed noise: check and charge the instruction against the owner's own plan
        (before any of its data is read), and the encoder of the round's units."""
        if protocol.SCALE not in cfg_rec:
            raise InstructionRefused("the train instruction lacks the scale of distributed noise")
        params = dict(model.named_parameters())
        dim = int(sum(params[n].numel() for n in split.shared))
        plan = charge_distributed(cfg, context, owner, instruction, dim, float(cfg_rec[protocol.SCALE]), session)
        return UnitEncoder(plan, numpy_rng(int(torch.randint(0, 2**62, (1,), generator=generator))))

    @staticmethod
    def _owner_release(cfg: JobConfig, model: nn.Module, split: ParamSplit, loader: DataLoader,
                       train_fn: TrainFn, z: float, generator: torch.Generator) -> dict[str, np.ndarray]:
        """Owner unit: the whole model trained by ``train_fn``; the shared update
        clipped to ``C`` (sensitivity ``C``: one owner), plus ``N(0, (z C)^2)`` under
        local noise (the server adds it under central noise). Where ``train_fn`` raises or
        leaves a non-finite update (a diverging loss, a NaN in the owner's data) the update
        is zero and the model is put back as it came (logged on the node only; the noise is
        still added): a zero update is within the clipping bound, so the sensitivity is
        unchanged, and whether the owner replies does not depend on its data."""
        before = get_arrays(model, tuple(n for n, _ in model.named_parameters()))
        failed = None
        try:
            train_fn(model, loader)
        except Exception as err:  # noqa: BLE001 - the user's code on the owner's data; its message stays here
            failed = f"the train function raised {type(err).__name__}: {err}"
        after = get_arrays(model, split.shared)
        delta = [after[n] - before[n] for n in split.shared]
        if failed is None and not all(np.all(np.isfinite(d)) for d in delta):
            failed = "the owner's update is non-finite (a diverging loss, or a non-finite value in the data?)"
        if failed is not None:
            log(WARNING, "Owner-unit update set to zero (noise still added under local noise; nothing of this "
                "is sent): %s", failed)
            set_arrays(model, before)
            delta = [np.zeros_like(before[n]) for n in split.shared]
        delta = clip_numpy(delta, cfg.clipping_norm)
        if cfg.placement is NoisePlacement.LOCAL:
            mech = GaussianSumMechanism(z, cfg.clipping_norm, 1.0, secure=cfg.secure_noise)
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            delta = mech.release_numpy(delta, numpy_rng(seed))
        return dict(zip(split.shared, delta, strict=True))


def _secure_only(cfg: JobConfig) -> bool:
    """Whether the run's owners release only inside flwr-jdp's secure sum (distributed noise:
    each adds a share of the noise its ledger charges, safe only once summed and masked)."""
    return cfg.dp and cfg.placement is NoisePlacement.DISTRIBUTED


def _add_mods(app: ClientApp, guard: ReplyGuard) -> None:
    """Put the reply guard (:mod:`flwr_jdp.reply_guard`: nothing but the release leaves
    the node) first on ``app`` and around the handlers it already has, then
    :func:`~flwr_jdp.joint_dp.distributed.secure_sum_mod`, so that ``noise-placement =
    "distributed"`` needs no change to the user's ClientApp (it passes every other
    message through) and the guard sees the reply as it leaves; the guard's train check
    again inside it, so what it sums is the release only. Under distributed noise an
    owner releases only inside it (:func:`~flwr_jdp.joint_dp.secure_sum.inside_secure_sum`:
    ``_train`` refuses, the guard drops, a train message that did not come through it).
    Handlers the app
    registered before JointDPClient was created do not get the secure sum; their
    secure-aggregation messages fail with Flower's own error (the README creates
    JointDPClient first)."""
    install(app, guard, secure_sum_mod, guard.train_only)


def _run_user_code(train_fn: TrainFn, model: nn.Module, loader: DataLoader) -> None:
    """``train_fn(model, loader)`` in the DP pass; an exception of the user's code becomes a
    :class:`UserLoopError` naming its type only (its message may hold data; it is logged here)."""
    try:
        train_fn(model, loader)
    except UserLoopError:
        raise
    except Exception as err:  # noqa: BLE001
        log(ERROR, "The train function raised in the DP pass: %s: %s", type(err).__name__, err)
        raise UserLoopError(f"the train function raised {type(err).__name__} in the DP pass (its message is "
                            "in the node's log, not sent)") from err


__all__ = ["JointDPClient", "hosting_mod", "owner_id", "owners_mod"]
