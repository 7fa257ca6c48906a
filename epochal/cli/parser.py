"""The ``epochal`` command line (also ``python -m epochal``).

- ``epochal coordinator``: the coordinator as a service for workers on any machine;
- ``epochal run``: a coordinator plus N local workers running a training script.

Exit status: 0 the run finished, 1 it was aborted (the reason is printed), 2 bad usage, 70 the
coordinator crashed (a bug; a restart with the same --run-dir resumes), 128+N stopped by signal N.
Neither command imports torch.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from epochal import __version__, log
from epochal.cli import configfile
from epochal.cli.argtypes import nonnegative_int, positive_int, seconds
from epochal.cli.settings import CHECKPOINTS, FAILURES, Option, add_options, field_options, grouped
from epochal.cli.suggest import close_matches
from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.serve.directories import RUN_DIR_FLAG, usable_dir
from epochal.coordinator.serve.resume import script_identity
from epochal.coordinator.serve.service import new_run_id
from epochal.environment import (
    COORDINATOR_ENV,
    LOG_FORMAT_ENV,
    LOG_LEVEL_ENV,
    TOKEN_ENV,
    VERBOSE_ENV,
)
from epochal.errors import ConfigError
from epochal.launch import preload, rerun
from epochal.launch.daemon import ServeOptions, serve_or_crash
from epochal.log import COORDINATOR, LAUNCHER
from epochal.observe import commands as observe_commands
from epochal.security.keycommand import (
    add_coordinator_arguments,
    add_keys_command,
    run_keys_command,
    server_security_from_args,
)

DEFAULT_RUNS = Path("runs")
"""Where a run without --run-dir keeps its run directory, RUNS/RUN_ID (under the working
directory)."""

EXIT_USAGE = 2


RUN_ONLY_OPTIONS = (
    Option(
        dest="fresh",
        action="store_true",
        group=CHECKPOINTS,
        help="discard what --run-dir holds (journal, result, checkpoints) and start over instead "
        "of resuming",
    ),
    Option(
        dest="resume",
        action="store_true",
        group=CHECKPOINTS,
        help="continue the newest run in runs/ of the same script and arguments (of a "
        "coordinator, for epochal coordinator) that has not finished, or that finished and is "
        "given more --epochs; with --run-dir, the run that directory holds",
    ),
    Option(
        dest="max_restarts",
        group=FAILURES,
        default=0,
        metavar="K",
        type=nonnegative_int,
        help="after a failure, hold a new rendezvous and resume from the last checkpoint, up to "
        "K times; in an elastic run (--min-workers) epochal run instead starts a replacement for "
        "each lost worker, up to K, which joins at the next epoch boundary",
    ),
)
"""Options of both commands that are not settings of the run (how it is served)."""


def run_options() -> list[Option]:
    """The options ``epochal run`` and ``epochal coordinator`` share, in their ``--help`` order:
    the command-line settings of :class:`CoordinatorConfig`, then :data:`RUN_ONLY_OPTIONS`."""
    return grouped([*field_options(CoordinatorConfig), *RUN_ONLY_OPTIONS])


def _add_run_options(p: argparse.ArgumentParser) -> None:
    add_options(p, run_options())


def _config(
    args: argparse.Namespace, world_size: int, token: str, run_id: str
) -> CoordinatorConfig:
    given = {option.dest: getattr(args, option.dest) for option in field_options(CoordinatorConfig)}
    if given["run_dir"] is None:  # see _run_dir
        given["run_dir"] = _runs() / run_id
    return CoordinatorConfig(world_size=world_size, token=token, **given)


def _runs() -> Path:
    """:data:`DEFAULT_RUNS`, made and tried. It is epochal's too: another user who could write in
    it could swap a run directory for a link between the check and the writes."""
    return usable_dir(DEFAULT_RUNS, kind="directory of runs", flag=RUN_DIR_FLAG)


class Parser(argparse.ArgumentParser):
    """argparse's parser, stricter and more helpful: an option is never taken for a shortening
    of another (``--epoch 2`` is refused, not read as ``--epochs 2``), and an unknown option is
    answered with the options of its command it most likely stands for. The commands' parsers
    are of this class too (argparse makes subparsers of their parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = _command_parser(self, parsed)
            unknown = [word.split("=", 1)[0] for word in extras if word.startswith("-")]
            guesses = [
                f"{guess[0]} for {word}" if len(unknown) > 1 else guess[0]
                for word in unknown
                if (guess := close_matches(word, _flags(command), n=1))
            ]
            hint = f"; did you mean {', '.join(guesses)}?" if guesses else ""
            command.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed


def _command_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` were parsed for."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(str(getattr(args, action.dest, "")))
            if isinstance(chosen, argparse.ArgumentParser):
                return _command_parser(chosen, args)
    return parser


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for flag in parser._option_string_actions if flag.startswith("--")]


def _run_dir(
    args: argparse.Namespace, words: list[str], command: Sequence[str] | None, run_id: str
) -> Path:
    """Where the run lives: ``--run-dir``; with ``--resume`` and no ``--run-dir``, the run it
    continues; else a new ``runs/RUN_ID``, saying so when an unfinished run of the same command
    is there (which ``--resume`` would have continued)."""
    if args.resume and args.fresh:
        if "--fresh" in words:
            raise ConfigError(
                "--resume continues a run and --fresh starts it over: give one of them"
            )
        args.fresh = False  # the settings file's fresh = true: the command line wins
    if args.run_dir is not None:
        if args.resume:
            rerun.require_run(args.run_dir)
        return Path(args.run_dir)
    runs = _runs()
    if args.resume:
        return rerun.run_to_resume(runs, command, args.epochs)
    earlier = rerun.unfinished_run(runs, command)
    if earlier is not None:
        logger = COORDINATOR if command is None else LAUNCHER
        logger.info(
            f"epochal: {earlier} holds an unfinished run of this command, which --resume "
            f"continues; starting a new one in {runs / run_id}"
        )
    return runs / run_id


def _add_log_options(p: argparse.ArgumentParser, default: str | None) -> None:
    """``--log-level`` and ``--log-format``, before the command or after it (a subcommand's
    ``default`` is SUPPRESS, so that it does not overwrite what was given before it)."""
    g = p.add_argument_group("logging")
    g.add_argument(
        "--log-level",
        choices=log.LEVELS,
        default=default,
        help=f"the least severe message to write (default: ${LOG_LEVEL_ENV}, else info); "
        "workers started here get the same",
    )
    g.add_argument(
        "--log-format",
        choices=log.FORMATS,
        default=default,
        help=f"text: each message as a line (default: ${LOG_FORMAT_ENV}, else text); json: one "
        "object a line with time, level, logger and message; workers started here get the same",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="epochal",
        description="Distributed data-parallel training of PyTorch models with a separate "
        "control plane.",
        epilog=f"Workers on other machines attach with {COORDINATOR_ENV}=tcp://HOST:PORT "
        "python SCRIPT. Exit status: 0 finished, 1 aborted, 2 bad usage, 70 crashed, "
        "130 interrupted (SIGINT), 143 stopped (SIGTERM); docs/cli.md lists a worker's own.",
    )
    parser.add_argument("--version", action="version", version=f"epochal {__version__}")
    _add_log_options(parser, None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_coordinator_command(sub)
    _add_run_command(sub)
    _add_worker_command(sub)
    add_keys_command(sub)
    observe_commands.add_commands(sub)
    preload.add_command(sub)
    return parser


def _add_coordinator_command(sub: Any) -> None:
    """``epochal coordinator``: the coordinator service for workers started elsewhere."""
    c = sub.add_parser(
        "coordinator",
        help="run the coordinator service for workers started elsewhere",
        description="Run the coordinator for one job: wait for --world-size workers, run the "
        "epochs, exit 0 when the run finishes or 1 when it is aborted. Prints the "
        "address it bound on stdout (so port 0 works), then the run directory; a run that "
        "stops before it finished ends with the command that continues it.",
    )
    c.add_argument(
        "--bind",
        default="tcp://127.0.0.1:0",
        metavar="ADDR",
        help="ZeroMQ endpoint to listen on (default: tcp://127.0.0.1:0, loopback on a "
        "free port; use tcp://0.0.0.0:PORT with --curve-key and --curve-allowed for workers "
        "on other machines)",
    )
    c.add_argument(
        "--world-size",
        type=positive_int,
        required=True,
        metavar="N",
        help="number of workers in the run",
    )
    c.add_argument(
        "--insecure",
        action="store_true",
        help="allow binding an address other than loopback without CURVE keys (anyone who can "
        "reach the port can then join or disturb the run)",
    )
    c.add_argument(
        "--address-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="after binding, write the address workers connect to (tcp://HOST:PORT, never "
        "0.0.0.0; EPOCHAL_HOST overrides HOST) to PATH atomically, and remove it at exit; "
        f"workers started with {COORDINATOR_ENV}=file:PATH wait for it and read it",
    )
    add_coordinator_arguments(c)
    _add_run_options(c)
    configfile.add_config_options(c, beside_script=False)
    _add_log_options(c, argparse.SUPPRESS)


def _add_run_command(sub: Any) -> None:
    """``epochal run``: a script on N local workers under an in-process coordinator."""
    r = sub.add_parser(
        "run",
        help="run a training script on N local workers under an in-process coordinator",
        description="Start a coordinator on loopback and N worker processes running SCRIPT, "
        "with every output line prefixed by its rank. The first line says the run directory "
        "(runs/RUN_ID unless --run-dir); a run that stops before it finished ends with the "
        "command that continues it (the same command with --resume does too), and a finished "
        "run given a larger --epochs is trained further.",
    )
    r.add_argument(
        "--nproc", type=positive_int, required=True, metavar="N", help="number of worker processes"
    )
    r.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="SCRIPT is a module name to run as `python -m SCRIPT`",
    )
    r.add_argument(
        "--verbose",
        action="store_true",
        help="show every line the workers print, also the tracebacks and noise that follow an "
        "abort (hidden by default: the cause is printed once)",
    )
    r.add_argument(
        "--exit-timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="after the run finished, kill workers still running S seconds later and exit 1 "
        "(default: none, the scripts end in their own time)",
    )
    _add_run_options(r)
    configfile.add_config_options(r, beside_script=True)
    _add_log_options(r, argparse.SUPPRESS)
    r.add_argument("script", metavar="SCRIPT", help="training script (or module with -m)")
    r.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments passed to SCRIPT"
    )


def _add_worker_command(sub: Any) -> None:
    """``epochal worker``: one worker on this machine under a supervisor that restarts it."""
    w = sub.add_parser(
        "worker",
        help="run one worker on this machine under a supervisor that restarts it",
        description="Run COMMAND as a worker of the coordinator at ADDR (it gets "
        f"{COORDINATOR_ENV}=ADDR) and start it again when it fails, up to --max-restarts times.",
        epilog="example: epochal worker --connect tcp://10.0.0.5:29400 --max-restarts 3 -- "
        "python train.py --lr 0.1",
    )
    w.add_argument("--connect", required=True, metavar="ADDR", help="the coordinator's address")
    w.add_argument(
        "--max-restarts",
        type=nonnegative_int,
        default=0,
        metavar="K",
        help="start COMMAND again after a failure, up to K times (default: 0)",
    )
    w.add_argument(
        "--restart-delay",
        type=seconds,
        default=1.0,
        metavar="S",
        help="seconds to wait before a restart (default: 1)",
    )
    w.add_argument(
        "--torchrun",
        action="store_true",
        help="COMMAND is a script written for torchrun (it calls init_process_group() itself and "
        "keeps its own loop): the supervisor joins the run for it and gives it torchrun's "
        "variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...)",
    )
    w.add_argument(
        "--verbose",
        action="store_true",
        help=f"the worker prints the full traceback of an error that stops the run (sets "
        f"{VERBOSE_ENV}=1; by default it prints the cause on one line)",
    )
    configfile.add_config_options(w, beside_script=False)
    _add_log_options(w, argparse.SUPPRESS)
    w.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")


BIND_SCHEMES = ("tcp", "ipc", "inproc")


def check_bind(bind: str) -> str:
    """Return ``bind`` if it is an endpoint the coordinator can bind, else a ConfigError.

    Caught here rather than by ZeroMQ, whose "Invalid argument" names neither the flag nor
    the fix.
    """
    scheme, sep, rest = bind.partition("://")
    if sep and scheme in ("ipc", "inproc") and rest:
        return bind
    host, colon, port = rest.rpartition(":")
    valid_port = port == "*" or (port.isdigit() and int(port) <= 65535)
    if scheme == "tcp" and sep and colon and host and valid_port:
        return bind
    raise ConfigError(
        f"--bind needs tcp://HOST:PORT (got {bind!r}): e.g. tcp://127.0.0.1:29400 for workers "
        "on this machine, tcp://0.0.0.0:29400 (with CURVE keys) for workers on others, port 0 "
        "for a free one; ipc://PATH also works on one machine"
    )


def check_exposure(bind: str, secured: bool, insecure: bool) -> str | None:
    """Refuse a non-loopback bind without CURVE unless --insecure; return a warning to print.

    A malformed ``bind`` is refused first (see :func:`check_bind`).
    """
    check_bind(bind)
    parts = urlsplit(bind)
    host = parts.hostname or ""
    if parts.scheme in ("ipc", "inproc") or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host or interface name: treat it as reachable from elsewhere
    if secured:
        return None
    if not insecure:
        raise ConfigError(
            f"{bind} is reachable from other machines and the coordinator has no CURVE keys: "
            "anyone who reaches the port could join the run or disturb it. Generate keys with "
            "`epochal keys generate DIR` and pass --curve-key/--curve-allowed, or pass "
            "--insecure on a network you trust"
        )
    return (
        f"warning: {bind} is served without CURVE (--insecure): any process that reaches it can "
        "join or disturb the run; set EPOCHAL_TOKEN on the coordinator and the workers at least"
    )


def _configure_logging(args: argparse.Namespace) -> None:
    """``--log-level`` / ``--log-format``, else the environment's, else info and text; this
    process's setting is what the workers it starts get (see :func:`log.child_environment`)."""
    level = args.log_level or os.environ.get(LOG_LEVEL_ENV) or "info"
    fmt = args.log_format or os.environ.get(LOG_FORMAT_ENV) or "text"
    try:
        log.configure(level, fmt)
    except ValueError as exc:  # only an environment variable can hold a value argparse refuses
        raise ConfigError(f"{LOG_LEVEL_ENV} / {LOG_FORMAT_ENV}: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args, settings_from = configfile.parse_args(parser, words)
    except ConfigError as exc:
        parser.exit(EXIT_USAGE, f"epochal: error: {exc}\n")
    token = os.environ.get(TOKEN_ENV, "")
    run_id = new_run_id()
    try:
        _configure_logging(args)
        if settings_from is not None:
            logger = COORDINATOR if args.command == "coordinator" else LAUNCHER
            logger.info(f"epochal: settings from {settings_from}")
        if args.command == "keys":
            return run_keys_command(args)
        handler = getattr(args, "handler", None)
        if handler is not None:  # plot, status, preload
            return int(handler(args))
        if args.command == "coordinator":
            security = server_security_from_args(args)
            warning = check_exposure(args.bind, security is not None, args.insecure)
            if warning:
                COORDINATOR.warning(f"epochal: {warning}")
            args.run_dir = _run_dir(args, words, None, run_id)
            config = _config(args, args.world_size, token, run_id)
            served = ServeOptions(
                bind=args.bind,
                fresh=args.fresh,
                max_restarts=args.max_restarts,
                address_file=args.address_file,
                curve_key=args.curve_key and Path(args.curve_key),
                curve_allowed=args.curve_allowed and Path(args.curve_allowed),
                resume_command=rerun.resume_command(words, args.run_dir),
            )
            return serve_or_crash(config, served, run_id, security)
        if args.command == "worker":
            from epochal.launch.supervisor import supervise

            command = args.worker_command
            if command[:1] == ["--"]:
                command = command[1:]
            if not command:
                parser.error("worker: give the command to run after --")
            return supervise(
                args.connect,
                command,
                max_restarts=args.max_restarts,
                restart_delay=args.restart_delay,
                verbose=args.verbose,
                torchrun=args.torchrun,
            )
        from epochal.launch.launcher import run_observed, script_command

        command = script_command(args.script, args.script_args, module=args.module)
        identity = script_identity(args.script, args.script_args, module=args.module)
        tail = 1 + len(args.script_args)  # the script and its arguments, the script's own
        args.run_dir = _run_dir(args, words[:-tail], identity["command"], run_id)
        config = replace(_config(args, args.nproc, token, run_id), **identity)
        return run_observed(
            config,
            args.nproc,
            command,
            run_id=run_id,
            fresh=args.fresh,
            max_restarts=args.max_restarts,
            verbose=args.verbose,
            exit_timeout=args.exit_timeout,
            resume_command=rerun.resume_command(words, args.run_dir, tail=tail),
        )
    except (ConfigError, FileNotFoundError) as exc:
        parser.exit(EXIT_USAGE, f"epochal: error: {exc}\n")
    except OSError as exc:
        parser.exit(EXIT_USAGE, f"epochal: error: {exc}\n")
    except KeyboardInterrupt:
        return 130
