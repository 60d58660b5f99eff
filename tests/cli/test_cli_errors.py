"""Hostile command lines and model files: one line on stderr naming the problem, non-zero exit,
never a traceback (issue 8, the CLI part); and ``load_gguf`` raises only ``ModelError``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache import cli, errors, storage
from recurrent_cache.cli import convert, demo, demo_prefix, demo_speculative, generate
from recurrent_cache.models import TRAINED_GGUF, ModelError, Sampler, load_gguf


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recurrent_cache", *args], capture_output=True, text=True,
                          timeout=120)


def run_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``python -m recurrent_cache ARGS`` without a new interpreter: same exit status and stderr."""
    try:
        status = cli.main(list(args))
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, captured.out, captured.err)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    for needle in needles:
        assert needle in lines[0], lines[0]


# -- numeric options out of range, malformed values, unknown options -------------------------------

BAD_OPTIONS = [
    (["--seed", "-1"], "--seed"),
    (["--seed", "9223372036854775808"], "--seed"),
    (["--seed", "abc"], "--seed"),
    (["--parallel", "2147483648"], "--parallel"),
    (["--parallel", "0"], "--parallel"),
    (["--clients", "0"], "--clients"),
    (["--clients", "-3"], "--clients"),
    (["--n-predict", "0"], "--n-predict"),
    (["--ubatch", "99999999999"], "--ubatch"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-k", "-1"], "--top-k"),
    (["--dtype", "f8"], "--dtype"),
    (["--no-such-option"], "--no-such-option"),
]


@pytest.mark.parametrize("args, named", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_demo_rejects_bad_option_in_one_line(capsys, args, named):
    assert_one_line_error(run_in_process(capsys, "demo", "--quiet", *args), named)


GENERATE_BAD = [
    (["x", "--seed", "-1"], "--seed"),
    (["x", "-n", "0"], "--n-predict"),
    (["x", "--n-predict", "2147483648000"], "--n-predict"),
    (["x", "--temperature", "inf"], "--temperature"),
    (["x", "--top-k", "-2"], "--top-k"),
    (["x", "--ubatch", "0"], "--ubatch"),
    ([], "prompt"),
    (["", "--random-weights"], "prompt is empty"),
    (["x", "--model", "a.gguf", "--random-weights"], "--random-weights"),
    (["x", "--model", ""], "--model"),
    (["x", "--model", "a\0b"], "NUL"),
    (["x", "--temperature", "0", "--top-k", "5"], "--top-k"),
]


@pytest.mark.parametrize("args, named", GENERATE_BAD, ids=[" ".join(a) or "no-prompt" for a, _ in GENERATE_BAD])
def test_generate_rejects_bad_invocation_in_one_line(capsys, args, named):
    assert_one_line_error(run_in_process(capsys, "generate", *args), named)


DEMO_BAD_VALUES = [
    (["--model", ""], "--model"),
    (["--store", ""], "--store"),
    (["--write-model", ""], "--write-model"),
    (["--model", "a\0b"], "NUL"),
    (["--temperature", "0", "--top-k", "5"], "--top-k"),
]


@pytest.mark.parametrize("args, named", DEMO_BAD_VALUES, ids=[" ".join(a) for a, _ in DEMO_BAD_VALUES])
def test_demo_rejects_empty_and_inert_values_in_one_line(capsys, args, named):
    assert_one_line_error(run_in_process(capsys, "demo", "--quiet", *args), named)


INSPECT_BAD = [(["x", "--max-cells", "-1"], "--max-cells"), (["x", "--max-tokens", "-5"], "--max-tokens"),
               (["x", "--bogus"], "--bogus")]


@pytest.mark.parametrize("args, named", INSPECT_BAD, ids=[" ".join(a) for a, _ in INSPECT_BAD])
def test_inspect_rejects_bad_invocation_in_one_line(capsys, args, named):
    assert_one_line_error(run_in_process(capsys, "inspect", *args), named)


def test_unknown_command_is_one_line(capsys):
    assert_one_line_error(run_in_process(capsys, "frobnicate"), "frobnicate")


# One real process per class of bad invocation and command: what a user's shell sees.
CLASSES = {
    "out-of-range": (["demo", "--seed", "-1"], ["generate", "x", "--top-k", "-1"]),
    "huge-number": (["demo", "--parallel", "2147483648"], ["generate", "x", "-n", "2147483648000"]),
    "not-a-number": (["demo", "--ubatch", "many"], ["generate", "x", "--temperature", "warm"]),
    "unknown-option": (["demo", "--bogus"], ["generate", "x", "--bogus"]),
    "empty-prompt": (None, ["generate", "", "--random-weights"]),
    "empty-value": (["demo", "--model", ""], ["generate", "x", "--model", ""]),
    "refused-combination": (["demo", "--fork", "--clients", "3"],
                            ["generate", "x", "--temperature", "0", "--top-k", "2"]),
}


REAL_PROCESS_CASES = [(kind, args) for kind in sorted(CLASSES) for args in CLASSES[kind] if args is not None]


@pytest.mark.parametrize("kind, args", REAL_PROCESS_CASES, ids=[f"{k}-{a[0]}" for k, a in REAL_PROCESS_CASES])
def test_bad_invocation_in_a_real_process(kind, args):
    assert_one_line_error(run_cli(*args))


# -- demo modes refuse the options they would ignore ------------------------------------------------

# The arguments that choose each mode, and what each mode does NOT use (written from what each does:
# --fork serves --parallel forks of one prompt, --prefix-cache and --speculative decode greedily,
# --write-model writes the model and exits).
MODE_ARGS = {"--fork": ["--fork"], "--prefix-cache": ["--prefix-cache"], "--store": ["--store", "states"],
             "--speculative": ["--speculative", "2"], "--write-model": ["--write-model", "out.gguf"]}
OPTION_ARGS = {"--clients": ["--clients", "3"], "--parallel": ["--parallel", "2"], "--n-predict": ["--n-predict", "2"],
               "--ubatch": ["--ubatch", "4"], "--dtype": ["--dtype", "f16"], "--seed": ["--seed", "1"],
               "--temperature": ["--temperature", "0.5"], "--top-k": ["--top-k", "5"],
               "--corrupt-step": ["--corrupt-step", "1"]}
IGNORED = {"--fork": {"--clients"}, "--prefix-cache": {"--temperature", "--top-k"},
           "--store": {"--temperature", "--top-k"}, "--speculative": {"--temperature", "--top-k"},
           "--write-model": set(OPTION_ARGS)}
# the mode a flag chooses, as the refusal names it (--store implies --prefix-cache)
MODE_NAMED = {**{flag: flag for flag in MODE_ARGS}, "--store": "--prefix-cache"}

REFUSED = [(mode, option) for mode in sorted(MODE_ARGS) for option in sorted(IGNORED[mode])]
ACCEPTED = [(mode, option) for mode in sorted(MODE_ARGS) for option in sorted(set(OPTION_ARGS) - IGNORED[mode])]
TWO_MODES = [(a, b) for a in sorted(MODE_ARGS) for b in sorted(MODE_ARGS)
             if a < b and {a, b} != {"--prefix-cache", "--store"}]


@pytest.mark.parametrize("mode, option", REFUSED, ids=[f"{m} {o}" for m, o in REFUSED])
def test_a_mode_refuses_an_option_it_would_ignore(capsys, tmp_path, monkeypatch, mode, option):
    monkeypatch.chdir(tmp_path)   # nothing may be written, but if it were, not into the repository
    result = run_in_process(capsys, "demo", *MODE_ARGS[mode], *OPTION_ARGS[option])
    assert_one_line_error(result, option, MODE_NAMED[mode], "ignored")
    assert result.returncode == 2 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("mode, option", ACCEPTED, ids=[f"{m} {o}" for m, o in ACCEPTED])
def test_a_mode_accepts_the_options_it_uses(mode, option):
    options = demo.parse_args([*MODE_ARGS[mode], *OPTION_ARGS[option]])
    name = option.removeprefix("--").replace("-", "_")
    assert str(getattr(options, name)) == OPTION_ARGS[option][1]


@pytest.mark.parametrize("first, second", TWO_MODES, ids=[f"{a} {b}" for a, b in TWO_MODES])
def test_two_modes_are_refused(capsys, tmp_path, monkeypatch, first, second):
    monkeypatch.chdir(tmp_path)
    result = run_in_process(capsys, "demo", *MODE_ARGS[first], *MODE_ARGS[second])
    assert_one_line_error(result, MODE_NAMED[first], MODE_NAMED[second], "choose one")
    assert result.returncode == 2 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("mode", ["--prefix-cache", "--speculative"])
def test_greedy_modes_accept_temperature_zero(mode):
    assert demo.parse_args([*MODE_ARGS[mode], "--temperature", "0"]).temperature == 0


def test_write_model_takes_a_seed_for_random_weights_only(capsys, tmp_path):
    assert demo.parse_args(["--write-model", "x.gguf", "--random-weights", "--seed", "3"]).seed == 3
    assert_one_line_error(run_in_process(capsys, "demo", "--write-model", str(tmp_path / "x.gguf"), "--seed", "3"),
                          "--seed", "--write-model")


def test_store_implies_prefix_cache():
    assert demo.parse_args(["--store", "states"]).prefix_cache


# -- the package's errors, from any command: one line, status 2 -----------------------------------


def package_errors() -> list[type[errors.RecurrentCacheError]]:
    """Every class of the package's hierarchy but OutputError (a failed stdout: test_cli_output.py)."""
    found, todo = [], [errors.RecurrentCacheError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return sorted((cls for cls in found if cls is not errors.OutputError), key=lambda cls: cls.__name__)


# command line -> (module, the name in it that the command's work goes through)
RAISING = {
    ("demo", "--quiet"): (demo, "serve_clients"),
    ("demo", "--prefix-cache", "--quiet"): (demo_prefix, "run"),
    ("demo", "--speculative", "2", "--quiet"): (demo_speculative, "run"),
    ("generate", "x", "-n", "3"): (generate, "serve"),
    ("convert", "hf_dir", "out.gguf"): (convert, "convert_hf_to_gguf"),
}


@pytest.mark.parametrize("error", package_errors(), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("args", RAISING, ids=" ".join)
def test_every_package_error_of_every_command_is_one_line(capsys, monkeypatch, args, error):
    """Whatever the package raises inside a command is ``PROG: MESSAGE`` and status 2."""
    def fail(*_args, **_kwargs):
        raise error(f"what went wrong ({error.__name__})")
    monkeypatch.setattr(*RAISING[args], fail)
    result = run_in_process(capsys, *args)
    assert (result.returncode, result.stderr) == (2, f"{args[0]}: what went wrong ({error.__name__})\n")


def test_an_unexpected_exception_is_still_a_traceback(capsys, monkeypatch):
    """A bug is reported as one: only the package's errors are the user's."""
    def fail(*_args, **_kwargs):
        raise KeyError("a bug")
    monkeypatch.setattr(generate, "serve", fail)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["generate", "x", "-n", "3"])


CACHE_COMMANDS = {"demo": ["demo", "--quiet", "--clients", "2", "--n-predict", "2"],
                  "demo --fork": ["demo", "--quiet", "--fork", "--n-predict", "2"],
                  "demo --prefix-cache": ["demo", "--quiet", "--prefix-cache", "--clients", "2", "--n-predict", "2"],
                  "demo --speculative": ["demo", "--quiet", "--speculative", "2", "--clients", "2",
                                         "--n-predict", "2"],
                  "generate": ["generate", "x", "-n", "2"]}


@pytest.mark.parametrize("name", CACHE_COMMANDS)
def test_a_device_torch_cannot_serve_is_named_in_one_line(capsys, monkeypatch, name):
    """TorchStorage's refusal of a device (storage.py), in its own words: not as cells that
    cannot be allocated, and before the model runs."""
    def no_cuda(device=None, host_access=None):
        raise rc.ConfigError(f"device {device!r}: Torch not compiled with CUDA enabled")
    monkeypatch.setattr(storage, "TorchStorage", no_cuda)
    result = run_in_process(capsys, *CACHE_COMMANDS[name], "--storage", "torch", "--device", "cuda")
    prog = CACHE_COMMANDS[name][0]
    assert (result.returncode, result.stderr) == (2, f"{prog}: device 'cuda': Torch not compiled with CUDA enabled\n")


@pytest.mark.needs_torch
@pytest.mark.parametrize("command", ["demo", "generate"])
def test_cuda_without_cuda_is_one_line_in_a_real_process(command):
    """The issue's run: ``--device cuda`` on a torch without CUDA."""
    torch = pytest.importorskip("torch", reason="--storage torch needs torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: --device cuda works here")
    args = CACHE_COMMANDS[command]
    result = run_cli(*args, "--storage", "torch", "--device", "cuda")
    assert_one_line_error(result, f"{command}: ", "cuda")
    assert result.returncode == 2


@pytest.mark.parametrize("name", ["demo", "generate"])
def test_storage_torch_without_torch_says_so(capsys, monkeypatch, name):
    """Without torch installed, the line names what is missing and how to get it."""
    monkeypatch.setitem(sys.modules, "torch", None)   # import torch raises ImportError
    result = run_in_process(capsys, *CACHE_COMMANDS[name], "--storage", "torch")
    assert (result.returncode, result.stderr) == (
        2, f"{name}: storage='torch' needs PyTorch: pip install 'recurrent_cache[torch]'\n")


# -- a newcomer's messages -------------------------------------------------------------------------


def test_no_command_lists_the_commands(capsys):
    result = run_in_process(capsys)
    assert_one_line_error(result, *cli.COMMANDS, "--help")
    assert result.returncode == 2


@pytest.mark.parametrize("command", [[], *([name] for name in cli.COMMANDS)], ids=lambda c: " ".join(c) or "top")
def test_help_has_no_markup(capsys, command):
    """--help is read in a terminal: no reST or Markdown backticks."""
    result = run_in_process(capsys, *command, "--help")
    assert result.returncode == 0 and "usage:" in result.stdout
    assert "`" not in result.stdout, result.stdout


def test_inspect_names_a_gguf_model_file(capsys):
    result = run_in_process(capsys, "inspect", str(TRAINED_GGUF))
    assert_one_line_error(result, str(TRAINED_GGUF), "GGUF model file", "--model")
    assert result.returncode == 1


def test_generate_takes_token_ids(capsys):
    """--tokens gives the same run as the text those ids encode."""
    text = run_in_process(capsys, "generate", "def ", "-n", "12", "--temperature", "0")
    ids = ",".join(map(str, b"def "))
    tokens = run_in_process(capsys, "generate", "--tokens", ids, "-n", "12", "--temperature", "0")
    assert tokens.returncode == text.returncode == 0, tokens.stderr
    assert tokens.stdout == text.stdout and tokens.stdout.startswith("def ")


GENERATE_TOKENS_BAD = [
    (["--tokens", "100,256"], ("256 is not a token of the model", "0 to 255")),
    (["--tokens", "1,,2"], ("--tokens", "''")),
    (["--tokens", "-1"], ("--tokens", "-1")),
    (["--tokens", "one"], ("--tokens", "'one'")),
    (["x", "--tokens", "1"], ("--tokens", "not allowed with argument prompt")),
    (["-n", "3"], ("prompt --tokens", "required")),
]


@pytest.mark.parametrize("args, needles", GENERATE_TOKENS_BAD, ids=[" ".join(a) for a, _ in GENERATE_TOKENS_BAD])
def test_generate_refuses_bad_token_ids_in_one_line(capsys, args, needles):
    result = run_in_process(capsys, "generate", *args)
    assert_one_line_error(result, *needles)
    assert result.returncode == 2


def test_a_model_without_vocabulary_takes_and_gives_token_ids(tmp_path, capsys):
    pytest.importorskip("gguf")
    from recurrent_cache.models import load_model, random_model, write_gguf
    path = tmp_path / "ids.gguf"
    write_gguf(random_model(seed=0, n_vocab=100, n_embd=16, n_layer=1, d_state=4), path)
    result = run_in_process(capsys, "generate", "--tokens", "7,8,9", "-n", "4", "--temperature", "0",
                            "--model", str(path))
    assert result.returncode == 0, result.stderr
    expected, _ = generate.generate(load_model(path), [7, 8, 9], 4, Sampler(), n_ubatch=64, dtype="f32")
    assert result.stdout == " ".join(map(str, [7, 8, 9, *expected])) + "\n"
    assert_one_line_error(run_in_process(capsys, "generate", "--tokens", "100", "--model", str(path)),
                          "100 is not a token", "0 to 99")


# -- Ctrl-C (a failing stdout: test_cli_output.py) -------------------------------------------------


def test_ctrl_c_is_one_line():
    """SIGINT while generate streams: one line, the shell's status for it, no traceback."""
    process = subprocess.Popen([sys.executable, "-m", "recurrent_cache", "generate", "x", "-n", "1000000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        process.stdout.read(4)   # it has started streaming: well inside main()
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=120)
    finally:
        process.kill()
    stderr = process.stderr.read().decode()
    assert status == 130 and stderr == "generate: interrupted\n", stderr


# -- bad model files --------------------------------------------------------------------------------


def bad_model_files(directory) -> dict[str, tuple[str, str]]:
    """name -> (path, a word the error must contain)."""
    good = TRAINED_GGUF.read_bytes()
    files = {}

    def make(name: str, data: bytes, needle: str) -> None:
        path = directory / f"{name}.gguf"
        path.write_bytes(data)
        files[name] = (str(path), needle)

    make("empty", b"", "empty")
    make("truncated-header", good[:300], "truncated")
    make("truncated-data", good[:len(good) // 2], "truncated")
    make("not-gguf", b"PK\x03\x04 a zip file, not a model" * 10, "not a GGUF file")
    make("bad-version", good[:4] + (99).to_bytes(4, "little") + good[8:], "version 99")
    # the same length so the file stays well-formed: only the architecture changes
    make("foreign-architecture", good.replace(b"mamba", b"llama", 1), "architecture 'llama'")
    make("huge-counts", good[:8] + (2**62).to_bytes(8, "little") + good[16:], "claims")
    files["missing"] = (str(directory / "absent.gguf"), "No such file")
    files["directory"] = (str(directory), "cannot read")
    return files


BAD_FILES = ["empty", "truncated-header", "truncated-data", "not-gguf", "bad-version", "foreign-architecture",
             "huge-counts", "missing", "directory"]


@pytest.mark.parametrize("name", BAD_FILES)
def test_load_gguf_raises_model_error_naming_file_and_problem(tmp_path, name):
    path, needle = bad_model_files(tmp_path)[name]
    with pytest.raises(ModelError) as caught:
        load_gguf(path)
    assert path in str(caught.value) and needle in str(caught.value)


@pytest.mark.parametrize("command", ["demo", "generate"])
@pytest.mark.parametrize("name", BAD_FILES)
def test_commands_reject_bad_model_file_in_one_line(tmp_path, capsys, command, name):
    path, needle = bad_model_files(tmp_path)[name]
    if name == "directory":  # --model reads a directory as a Hugging Face checkpoint
        needle = "config.json: missing"
    args = ["demo", "--quiet", "--model", path] if command == "demo" else ["generate", "x", "--model", path]
    assert_one_line_error(run_in_process(capsys, *args), path, needle)


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_bad_model_file_in_a_real_process(tmp_path, command):
    path, needle = bad_model_files(tmp_path)["truncated-data"]
    args = ["demo", "--quiet", "--model", path] if command == "demo" else ["generate", "x", "--model", path]
    assert_one_line_error(run_cli(*args), path, needle)


def test_every_truncation_and_random_corruption_gives_model_error_or_a_model(tmp_path):
    """Cut the shipped file at many lengths and flip random header bytes: load_gguf either loads
    a model or raises ModelError — never another exception."""
    good = TRAINED_GGUF.read_bytes()
    path = tmp_path / "damaged.gguf"
    rng = np.random.default_rng(13)
    header_end = 4096
    cuts = sorted(set(range(0, header_end, 7)) | set(rng.integers(header_end, len(good), 20).tolist()))
    for cut in cuts:
        path.write_bytes(good[:cut])
        with pytest.raises(ModelError):
            load_gguf(path)
    loaded = 0
    for _ in range(300):
        data = bytearray(good)
        for at in rng.integers(0, header_end, size=int(rng.integers(1, 4))):
            data[at] = int(rng.integers(0, 256))
        path.write_bytes(bytes(data))
        try:
            load_gguf(path)
            loaded += 1
        except ModelError:
            pass
    assert loaded < 300, "no corruption was detected: the header bytes were not where they were expected"


def test_a_model_without_vocabulary_cannot_take_text(tmp_path, capsys):
    pytest.importorskip("gguf")
    from recurrent_cache.models import random_model, write_gguf
    path = tmp_path / "ids.gguf"
    write_gguf(random_model(seed=0, n_vocab=100, n_embd=16, n_layer=1, d_state=4), path)
    assert_one_line_error(run_in_process(capsys, "generate", "x", "--model", str(path)), "no vocabulary", "--tokens")
    result = run_in_process(capsys, "demo", "--quiet", "--model", str(path), "--clients", "2", "--n-predict", "3")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stderr  # random token-id prompts


def test_no_hang_and_no_traceback_when_the_model_file_is_a_fifo(tmp_path, capsys):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert_one_line_error(run_in_process(capsys, "generate", "x", "--model", str(fifo)), str(fifo))


def test_shutil_copy_of_the_shipped_model_loads(tmp_path):
    """The control case for the damaged files: an intact copy loads."""
    shutil.copy(TRAINED_GGUF, tmp_path / "copy.gguf")
    assert load_gguf(tmp_path / "copy.gguf").hparams.n_vocab == 256


def test_nan_weights_are_refused_with_the_tensor_name(tmp_path):
    from recurrent_cache.models.gguf_file import GGUFFile
    good = TRAINED_GGUF.read_bytes()
    info = GGUFFile(TRAINED_GGUF).tensors["blk.1.ssm_d"]  # f32
    data = bytearray(good)
    data[info.offset:info.offset + 4] = np.float32("nan").tobytes()
    (tmp_path / "nan.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelError, match="tensor blk.1.ssm_d holds 1 values that are NaN or infinite"):
        load_gguf(tmp_path / "nan.gguf")
