"""The `orpheus-tts` command: a dispatcher that imports each subcommand's module only when it runs.

`orpheus-tts --help` imports no torch. Errors a person is likely to meet first (weights not
cached, a wrong path, a missing optional dependency, a bad value) print one line with the
remedy; `--verbose` (before or after the subcommand) shows the traceback. Ctrl-C is one line and
exit status 130.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Iterator
from types import ModuleType

from . import __version__
from .errors import EngineError
from .interrupt import interrupted

DEVICE_HELP = "auto, cpu, cuda or cuda:N"
JSON_HELP = "also write the figures to this JSON file"


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help followed by its default, where it has one worth showing (not None, False or empty) and the
    help does not name it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.option_strings and action.default not in (None, False, [], (), argparse.SUPPRESS)
        return f"{text} (default: %(default)s)" if shown and "default" not in text else text


def _ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of ints."""
    return tuple(int(v) for v in text.split(",") if v.strip())


def _handler(target: str) -> dict[str, str]:
    """set_defaults() value naming the function that runs a subcommand, as 'module:function'."""
    return {"handler": target}


def _add_owned(sub: argparse._SubParsersAction, name: str, summary: str, module: ModuleType, func: str) -> None:
    """A subcommand whose module declares its flags (`add_arguments`) and runs it (`func`): one home for both."""
    parser = sub.add_parser(name, help=summary)
    module.add_arguments(parser)
    parser.set_defaults(**_handler(f"{module.__name__.removeprefix(f'{__package__}.')}:{func}"))


def _add_say(sub: argparse._SubParsersAction) -> None:
    from .config import BACKENDS
    from .spec import ENGLISH

    say = sub.add_parser("say", help="speak text to a WAV file")
    say.add_argument("text", help="what to say; <laugh>-style tags are kept")
    say.add_argument("--model", default="canopylabs/orpheus-3b-0.1-ft", help="hub id or local directory")
    say.add_argument("--snac", default="hubertsiuzdak/snac_24khz", help="hub id or local directory")
    say.add_argument("--backend", default="hf", choices=BACKENDS, help="what generates the tokens (docs/backends.md)")
    say.add_argument("--device", default="auto", help=DEVICE_HELP)
    voices = ", ".join(ENGLISH.voices)
    say.add_argument(
        "--voice", default=None, help=f"{voices} (default {ENGLISH.default_voice}); other languages: docs/voices.md"
    )
    say.add_argument("--out", required=True, help="the WAV file to write (24 kHz, mono, 16-bit)")
    say.add_argument("--save-tokens", default=None, help="save generated ids (.npy) for `decode`")
    say.add_argument("--seed", type=int, default=None, help="fix the sampled tokens (default: random)")
    say.set_defaults(**_handler("tools.say:say_main"))


def _add_decode(sub: argparse._SubParsersAction) -> None:
    dec = sub.add_parser("decode", help="replay saved token ids through the decoder")
    dec.add_argument("tokens", help="token ids saved by `say --save-tokens` (.npy)")
    dec.add_argument("--snac", default="hubertsiuzdak/snac_24khz", help="hub id or local directory")
    dec.add_argument("--out", required=True, help="the WAV file to write")
    dec.add_argument("--offline", action="store_true", help="decode each utterance whole instead of streaming")
    dec.add_argument("--device", default="cpu", help=DEVICE_HELP)
    dec.add_argument("--model-family", default="orpheus-en", help="token ids and voices (docs/voices.md)")
    dec.add_argument("--first-chunk-frames", type=int, default=4, help="frames before the first decode")
    dec.add_argument("--noise-seed", type=int, default=0, help="seed of SNAC's noise table")
    dec.set_defaults(**_handler("tools.replay:decode_main"))

    cmp_ = sub.add_parser("compare", help="max abs difference of two WAVs (exit 1 above the tolerance)")
    cmp_.add_argument("a", help="a WAV file")
    cmp_.add_argument("b", help="a WAV file of the same length")
    cmp_.add_argument("--tolerance", type=int, default=33, help="largest int16 difference that passes")
    cmp_.set_defaults(**_handler("tools.wav:compare_main"))


def _add_weights(sub: argparse._SubParsersAction) -> None:
    dl = sub.add_parser("download", help="fetch Orpheus and SNAC weights into the Hugging Face cache")
    dl.add_argument("--model", default="canopylabs/orpheus-3b-0.1-ft", help="hub id (gated: set HF_TOKEN)")
    dl.add_argument("--snac", default="hubertsiuzdak/snac_24khz", help="hub id")
    dl.set_defaults(**_handler("weights:download_main"))

    mk = sub.add_parser("make-test-model", help="write random-weight Orpheus-shaped and SNAC checkpoints")
    mk.add_argument("dir", help="writes DIR/orpheus (--model) and DIR/snac (--snac)")
    mk.add_argument(
        "--snac", choices=("full", "tiny"), default="full",
        help="full: the real 24 kHz architecture (decoder benchmarks); tiny: narrow and fast (tests, first tries)",
    )  # fmt: skip
    mk.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    mk.add_argument("--head-dim", type=int, default=32, help="attention head width (vLLM's CPU build needs >= 32)")
    mk.add_argument(
        "--adapter", action="append", metavar="ADIR", help="also write a random LoRA adapter (PEFT) to ADIR; repeatable"
    )
    mk.set_defaults(**_handler("tools.testmodel:make_test_model_main"))

    from .tools import quantize

    q_help = "FP8-quantise an Orpheus checkpoint with NVIDIA ModelOpt (for trtllm/vllm)"
    _add_owned(sub, "quantize", q_help, quantize, "quantize_main")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    """`bench decoder | overhead | host | layers | backend | engine`, each with its own flags."""
    from .tools.bench import engine as bench_engine

    bench = sub.add_parser("bench", help="report decoder and engine figures")
    what = bench.add_subparsers(dest="what", required=True)
    dec = what.add_parser("decoder", help="SNAC decode CPU per audio second: project vs reference scheme")
    dec.add_argument("--snac", default="hubertsiuzdak/snac_24khz", help="SNAC checkpoint")
    dec.add_argument("--streams", type=int, default=8, help="concurrent streams")
    dec.add_argument("--seconds", type=float, default=4.0, help="audio seconds per stream")
    dec.add_argument("--device", default="cpu", help=DEVICE_HELP)
    dec.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    over = what.add_parser("overhead", help="host CPU per token: synthetic backend, no-op decoder")
    over.add_argument("--streams", type=int, default=256, help="concurrent streams")
    over.add_argument("--frames", type=int, default=48, help="frames per utterance")
    over.add_argument("--rate", type=float, default=0.0, help="tokens/s per stream (0 = flat out)")
    over.add_argument("--loops", type=int, default=1, help="consumer event loops (threads)")
    for p in (dec, over):
        p.add_argument("--json", default=None, help=JSON_HELP)
        p.set_defaults(**_handler("tools.bench.micro:main"))
    host = what.add_parser("host", help="aten ops and host ms per steady decoder tick, eager and compiled")
    host.add_argument("--snac", default="hubertsiuzdak/snac_24khz", help="SNAC checkpoint")
    host.add_argument("--streams", type=_ints, default=(1, 16, 64, 256), help="stream counts, e.g. 1,16,64,256")
    host.add_argument("--device", default="cpu", help=DEVICE_HELP)
    host.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    host.add_argument("--ticks", type=int, default=5, help="timed steady ticks per point")
    host.add_argument("--no-compile", dest="compile", action="store_false", help="eager only")
    host.add_argument("--json", default=None, help=JSON_HELP)
    host.set_defaults(**_handler("tools.bench.host:main"))
    lay = what.add_parser("layers", help="each decoder layer's ms per steady call beside its matmul (kernel cliffs)")
    lay.add_argument("--snac", default="hubertsiuzdak/snac_24khz", help="SNAC checkpoint")
    lay.add_argument("--rows", type=_ints, default=(1, 8), help="rows (streams) per call, e.g. 1,8")
    lay.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    lay.add_argument("--calls", type=int, default=20, help="timed calls per layer")
    lay.add_argument("--unpacked", action="store_true", help="every product through torch.mm (as compiled; before)")
    lay.add_argument("--json", default=None, help=JSON_HELP)
    lay.set_defaults(**_handler("tools.bench.layers:main"))
    back = what.add_parser("backend", help="tokens/s of a backend's decode step by batch size, old vs new sampler")
    back.add_argument("--backend", default="hf", choices=("hf",), help="the backend whose step is timed")
    back.add_argument("--model", required=True, help="model dir or hub id")
    back.add_argument("--batch", type=_ints, default=(1, 16, 64, 256), help="batch sizes, e.g. 1,16,64,256")
    back.add_argument("--device", default="cpu", help=DEVICE_HELP)
    back.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    back.add_argument("--steps", type=int, default=20, help="timed decode steps per point")
    back.add_argument("--json", default=None, help=JSON_HELP)
    back.set_defaults(**_handler("tools.bench.backend:main"))
    from .tools.bench import lora as bench_lora

    _add_owned(what, "lora", "tokens/s of the hf step with LoRA adapters configured and used", bench_lora, "main")
    eng_help = "TTFB, underruns and real-time capacity of the engine under traffic"
    _add_owned(what, "engine", eng_help, bench_engine, "main")


def _add_server(sub: argparse._SubParsersAction) -> None:
    """`serve` (one engine behind WebSocket + OpenAI HTTP) and `load` (the harness that drives it)."""
    from .server import serve
    from .tools import load

    _add_owned(sub, "serve", "serve one engine over WebSocket and OpenAI-compatible HTTP", serve, "serve_main")
    _add_owned(sub, "load", "drive a serve endpoint with concurrent streams from a process pool", load, "main")


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every subcommand's parser under `parser`, at any depth (`bench engine` too)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # an alias names the same parser
                yield sub
                yield from _subparsers(sub)


def build_parser() -> argparse.ArgumentParser:
    """The whole `orpheus-tts` command line (no subcommand module that needs torch is imported)."""
    p = argparse.ArgumentParser(prog="orpheus-tts", description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="show full tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_say, _add_decode, _add_weights, _add_bench, _add_server):
        add(sub)
    for parser in _subparsers(p):  # after the subcommand too; SUPPRESS keeps a --verbose given before it
        parser.formatter_class = HelpFormatter
        parser.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks"
        )
    return p


def _run(target: str, args: argparse.Namespace) -> int:
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), func)(args)


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the subcommand; a user-facing error is one line on stderr and exit status 2, Ctrl-C
    one line and status 130."""
    args = build_parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO)
    else:  # the one-line error below says it all; the engine's own log lines would repeat it
        logging.getLogger(__package__).addHandler(logging.NullHandler())
    try:
        if args.command == "bench":  # every figure is printed beside the host it was measured on
            from .tools.bench.common import host_line

            print(host_line(), flush=True)
        return _run(args.handler, args)
    except (EngineError, ImportError, FileNotFoundError, ValueError, TypeError) as exc:
        if args.verbose:
            traceback.print_exc()
        hint = "" if args.verbose else " (--verbose shows the traceback)"
        print(f"orpheus-tts {args.command}: error: {exc}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        return interrupted(args.command, str(exc))


if __name__ == "__main__":
    sys.exit(main())
