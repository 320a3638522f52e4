"""A legacy Flower app (``client_fn`` returning a ``NumPyClient``) under joint DP.

Flower's older examples build their ClientApp from a ``client_fn``::

    class FlowerClient(NumPyClient):
        def __init__(self, net, trainloader, valloader, local_epochs):
            self.net, self.trainloader, self.valloader = net, trainloader, valloader
            ...
        def fit(self, parameters, config):
            set_weights(self.net, parameters)
            train(self.net, self.trainloader, self.local_epochs)
            return get_weights(self.net), len(self.trainloader.dataset), {}
        def evaluate(self, parameters, config):
            set_weights(self.net, parameters)
            loss, accuracy = test(self.net, self.valloader)
            return loss, len(self.valloader.dataset), {"accuracy": accuracy}

    def client_fn(context):
        return FlowerClient(Net(), *load_data(context), ...).to_client()

    app = ClientApp(client_fn=client_fn)

Under joint DP the last line becomes ``app = numpy_client_app(client_fn)``; the
client class and ``client_fn`` stay as they are. Each message builds a client with
``client_fn(context)`` and uses its model and training loader, found by attribute
(``net`` and ``trainloader`` by default: Flower's examples' names):

- **train**: :meth:`~flwr_jdp.joint_dp.client.JointDPClient.train` with a train
  function that points the client's model and loader attributes at the model and
  loader flwr-jdp hands it (the personal fit, the dry run, the DP pass) and calls the
  client's own ``fit(their current parameters, config)``. ``config`` is the server's
  ``train_config`` (without flwr-jdp's own keys). What ``fit`` returns is not sent:
  the reply is the DP pass's release, as with any drop-in app.
- **evaluate**: the owner's model (:meth:`~flwr_jdp.joint_dp.client.JointDPClient.load`,
  personal layers fitted on the broadcast by ``fit`` with the last train round's
  config), then the client's own ``evaluate(its parameters, config)``; the reply's
  metrics are its metrics plus ``loss`` and ``num-examples`` (numbers only: a string
  or bytes metric is left out, with a warning).

``fit`` and ``evaluate`` receive the model's ``state_dict()`` values in order, which
is what Flower's ``set_weights(net, parameters)`` helpers load, so the user's
``set_weights`` loads the values the model already holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from torch import nn
from torch.utils.data import DataLoader

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.client import JointDPClient
from flwr_jdp.joint_dp.config import ConfigError

#: ``context.state`` key of the last train round's config (the personal fit in evaluate uses it).
FIT_CONFIG_KEY = "jdp.legacy-fit-config"
#: flwr-jdp's own keys of a train/evaluate message's config record (not passed to ``fit``/``evaluate``).
_PROTOCOL_KEYS = frozenset({protocol.ROUND, protocol.OWNERS, protocol.SAMPLE_RATES, protocol.STEPS,
                            protocol.NOISE_MULTIPLIER, protocol.SESSION, protocol.SCALE})


def numpy_client_app(client_fn: Callable[[Context], Any], *, net: str = "net", trainloader: str = "trainloader",
                     model_fn: Callable[..., nn.Module] | None = None,
                     user_ids: Callable[[Context], Sequence[int]] | None = None,
                     mods: list | None = None) -> ClientApp:
    """The joint-DP ClientApp of a legacy app: use it where the app had
    ``ClientApp(client_fn=client_fn)``.

    Parameters
    ----------
    client_fn : callable
        The app's own ``client_fn(context)``, returning a ``NumPyClient`` or its
        ``to_client()``.
    net, trainloader : str
        The client's attributes holding its ``nn.Module`` and its training
        ``DataLoader`` (Flower's examples: ``self.net``, ``self.trainloader``).
    model_fn : callable, optional
        As for :class:`~flwr_jdp.joint_dp.client.JointDPClient` (e.g. ``Net``); by
        default the model of a new ``client_fn(context)``.
    user_ids : callable, optional
        As for :class:`~flwr_jdp.joint_dp.client.JointDPClient` (``privacy-unit = "user"``).
    mods : list, optional
        The ClientApp's mods (e.g. ``[owners_mod]``).
    """
    app = ClientApp(mods=list(mods or []))
    route = NumPyClientRoute(app, client_fn, net=net, trainloader=trainloader, model_fn=model_fn,
                             user_ids=user_ids)
    app.train()(route.train)
    app.evaluate()(route.evaluate)
    return app


class NumPyClientRoute:
    """The train and evaluate handlers of :func:`numpy_client_app` (one per app)."""

    def __init__(self, app: ClientApp, client_fn: Callable[[Context], Any], *, net: str, trainloader: str,
                 model_fn: Callable[..., nn.Module] | None,
                 user_ids: Callable[[Context], Sequence[int]] | None) -> None:
        self.client_fn = client_fn
        self.net, self.trainloader = net, trainloader
        self.jdp = JointDPClient(
            app, model_fn=model_fn or (lambda context: self._attr(self.client(context), self.net, nn.Module)),
            train_data=lambda context: self._attr(self.client(context), self.trainloader, DataLoader),
            user_ids=user_ids)

    def client(self, context: Context) -> Any:
        """The ``NumPyClient`` of a new ``client_fn(context)`` (unwrapped from ``to_client()``)."""
        client = self.client_fn(context)
        return getattr(client, "numpy_client", client)

    def _attr(self, client: Any, name: str, kind: type) -> Any:
        value = getattr(client, name, None)
        if not isinstance(value, kind):
            key, what = ("net", "nn.Module") if kind is nn.Module else ("trainloader", "DataLoader")
            found = sorted(k for k, v in vars(client).items() if isinstance(v, kind))
            raise ConfigError(f"the client that client_fn returns has no {what} in attribute '{name}' (its "
                              f"{what} attributes: {found}): pass numpy_client_app(client_fn, {key}=...)")
        return value

    # ------------------------------------------------------------------ handlers
    def train(self, msg: Message, context: Context) -> Message:
        """The client's own ``fit`` as the train function of the DP pass."""
        client = self.client(context)  # a wrong attribute name was refused at set-up
        model = self._attr(client, self.net, nn.Module)
        loader = self._attr(client, self.trainloader, DataLoader)
        config = user_config(msg)
        context.state[FIT_CONFIG_KEY] = ConfigRecord(config)
        return self.jdp.train(msg, context, model, loader, self._fit(client, config))

    def evaluate(self, msg: Message, context: Context) -> Message:
        """The owner's model, then the client's own ``evaluate``."""
        client = self.client(context)
        model = self._attr(client, self.net, nn.Module)
        loader = self._attr(client, self.trainloader, DataLoader)
        fit_config = context.state.get(FIT_CONFIG_KEY)
        fit = self._fit(client, dict(fit_config) if isinstance(fit_config, ConfigRecord) else user_config(msg))
        model = self.jdp.load(model, msg, context, fit=lambda m: fit(m, loader))
        loss, num_examples, metrics = client.evaluate(weights(model), user_config(msg))
        kept = {k: v for k, v in dict(metrics).items()
                if isinstance(v, int | float | np.number) and not isinstance(v, bool)}
        if len(kept) != len(metrics):
            log(WARNING, "evaluate: metrics %s are not numbers and are not sent", sorted(set(metrics) - set(kept)))
        reply = MetricRecord({**{k: float(v) for k, v in kept.items()}, protocol.LOSS: float(loss),
                              protocol.NUM_EXAMPLES: int(num_examples)})
        return Message(RecordDict({protocol.METRICS: reply}), reply_to=msg)

    def _fit(self, client: Any, config: dict) -> Callable[[nn.Module, DataLoader], None]:
        """``train_fn(net, loader)``: the client's ``fit`` on ``net`` and ``loader``, its
        attributes pointed at them for the call (its return value is not used)."""

        def train_fn(net: nn.Module, loader: DataLoader) -> None:
            saved = getattr(client, self.net), getattr(client, self.trainloader)
            setattr(client, self.net, net)
            setattr(client, self.trainloader, loader)
            try:
                client.fit(weights(net), dict(config))
            finally:
                setattr(client, self.net, saved[0])
                setattr(client, self.trainloader, saved[1])

        return train_fn


def weights(model: nn.Module) -> list[np.ndarray]:
    """``model``'s ``state_dict()`` values as NumPy arrays (copies), in order: what
    Flower's ``get_weights(net)`` gives and ``set_weights(net, parameters)`` loads."""
    return [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]


def user_config(msg: Message) -> dict:
    """The app's own keys of ``msg``'s config record (its ``train_config`` /
    ``evaluate_config``), without flwr-jdp's."""
    rec = msg.content.get(protocol.CONFIG)
    return {k: v for k, v in rec.items() if k not in _PROTOCOL_KEYS} if isinstance(rec, ConfigRecord) else {}


__all__ = ["NumPyClientRoute", "numpy_client_app", "user_config", "weights"]
