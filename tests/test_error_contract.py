"""One error contract: every exception class `optimized` defines is a `UsageError` (a problem the user can fix;
`python -m optimized` prints it as one line and exits with status 2), or an internal error listed, with the reason,
in INTERNAL below. A new user-facing error class that forgets UsageError fails here."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import optimized
from optimized.errors import UsageError

# Not the user's to fix by an option, a file or the launch: what each one means instead.
INTERNAL = {
    "optimized.executor.model_runner.NonFiniteLogitsError",  # the model produced NaN / inf (a serving request
    #   fails with it; `generate` still reports it as one line, Assembly.named_errors)
    "optimized.serving.protocol.ApiError",  # an HTTP error response to a client, never the CLI's
    "optimized.serving.driver.EngineStopped",  # the engine thread died: a bug or a device failure
    "optimized.serving.driver.RequestFailed",  # one request failed inside the engine
    "optimized.pd.transfer_engine.TransferError",  # the KV transfer engine refused a write (a peer gone)
    "optimized.pd.digest.KvIntegrityError",  # the decode side's KV is not what prefill sent: the request fails
    "optimized.pd.router.RouterError",  # the PD router's HTTP error response to a client, never the CLI's
    "optimized.pd.router.Relayed",  # an instance's own error response, passed on to the client
    "optimized.pd.router.ClientGone",  # the client left while the router waited: it only ends that request's work
    "optimized.pd.router_instances.InstanceDown",  # an instance unreachable: a 503 to the client (at start: a
    #   UsageError naming it)
    "optimized.pd.instance.UnknownTransfer",  # a transfer id no request holds (released or timed out): HTTP 404
    "optimized.serving.routes.pd.ClientGone",  # the client left during the KV hand-off: nobody to tell
    "optimized.torchair_standin.StaticGraphError",  # graph mode compiled a GE graph dynamically: a bug, not a setting
}


def _modules():
    for info in pkgutil.walk_packages(optimized.__path__, "optimized."):
        try:
            yield importlib.import_module(info.name)
        except ImportError as e:  # an optional dependency (fastapi, httpx, torch_npu) this host lacks
            if e.name and e.name.split(".")[0] == "optimized":
                raise


def exception_classes() -> dict[str, type]:
    found = {}
    for module in _modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(cls, BaseException)
                and not issubclass(cls, Warning)  # warnings are not errors
                and cls.__module__.startswith("optimized")
            ):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


CLASSES = exception_classes()


def test_the_walk_finds_the_package_errors():
    assert {
        "optimized.errors.UsageError",
        "optimized.errors.CheckpointError",
        "optimized.config.ConfigError",
        "optimized.envs.EnvError",
    } <= set(CLASSES)
    assert len(CLASSES) >= 20


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_error_is_a_usage_error_or_listed_internal(name):
    cls = CLASSES[name]
    if name in INTERNAL:
        assert not issubclass(cls, UsageError) or name.startswith("optimized.layers."), (
            f"{name} is a UsageError now: remove it from INTERNAL"
        )
        return
    assert issubclass(cls, UsageError), (
        f"{name} is neither a UsageError (a problem the user can fix) nor listed in INTERNAL with the reason it is not"
    )


def test_internal_list_names_existing_classes():
    stale = {n for n in INTERNAL if n not in CLASSES and not n.startswith("optimized.layers.")}
    assert not stale, f"INTERNAL names classes that no longer exist: {sorted(stale)}"


@pytest.mark.parametrize(
    "name, base",
    [
        ("optimized.config.ConfigError", ValueError),
        ("optimized.errors.CheckpointError", ValueError),
        ("optimized.model_loader.tokenizer.PromptError", ValueError),
        ("optimized.distributed.guard.CollectiveTimeoutError", RuntimeError),
        ("optimized.executor.profiling.ProfilerError", OSError),
        ("optimized.envs.EnvError", ValueError),
    ],
)
def test_usage_errors_keep_their_second_base(name, base):
    assert issubclass(CLASSES[name], base)  # existing `except ValueError` / `except OSError` callers still work


def test_the_cli_prints_a_usage_error_as_one_line_with_status_2(monkeypatch, capsys):
    from optimized.cli import main as cli
    from optimized.config import ConfigError

    def boom(args):
        raise ConfigError([("model_config.dtype", "must be one of bfloat16, float32")], "x.yaml")

    monkeypatch.setattr(cli.SUBCOMMANDS["convert"], "run", boom)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convert", "--quant", "w4a8", "src", "dst"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m optimized: error: invalid inference config x.yaml")
