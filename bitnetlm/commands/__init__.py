"""CLI commands: each module has add_arguments(parser) and run(args) -> int, and wraps a library function."""


def add_torch_threads(parser) -> None:
    """`-t/--threads` (the runtime group's flag) for a command whose work is PyTorch's own CPU ops."""
    from bitnetlm.runtime.args import add_runtime_arguments

    add_runtime_arguments(parser, ("threads",))


def apply_torch_threads(args) -> None:
    """PyTorch's intra-op threads from `-t/--threads` (validated as every runtime flag is); unset: its default."""
    from bitnetlm.runtime.args import runtime_from_args

    threads = runtime_from_args(args, ("threads",)).threads
    if threads:
        import torch

        torch.set_num_threads(threads)
