"""Every command README.md, docs/ and the docstrings of configs/, rloo_jax/ and experiments/ give
still parses: the flags of `python -m rloo_jax.*` and of the scripts in experiments/ exist (a
script's own argparse parses the arguments), and each `--config=FILE[:ARG]` with its
`--config.*` overrides loads through ml_collections as the command line would and passes the
settings' own checks. Nothing trains or compiles."""
import argparse
import ast
import functools
import glob
import json
import os
import re
import runpy
import shlex
import sys
from unittest import mock

import pytest
from absl import flags
from ml_collections import config_flags

from rloo_jax import algorithms, experiment
from rloo_jax import cli  # noqa: F401  (registers the comma-list parser the CLI uses)

from conftest import REPO

# absl's own flags, which every `python -m rloo_jax.*` entry point accepts.
ABSL_FLAGS = {"verbosity", "v", "logtostderr", "alsologtostderr", "log_dir", "help", "helpfull"}
# config_flags loads a config file with importlib's load_module.
pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")
PLACEHOLDER = re.compile(r"\.\.\.|<|~|/ckpt/|\{")  # a path the reader (or an f-string) fills in


def _commands():
  """(file, program, argument string) for each `python -m rloo_jax.X` / `python experiments/X.py`
  in README.md, docs/*.md and the docstrings of configs/, rloo_jax/ and experiments/,
  continuation lines joined."""
  found = []
  sources = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=REPO)) + sorted(
      p for d in ("configs", "rloo_jax", "experiments")
      for p in glob.glob(f"{d}/**/*.py", root_dir=REPO, recursive=True))
  for path in sources:
    text = open(os.path.join(REPO, path)).read()
    if path.endswith(".py"):  # its docstrings (strings in code build commands, not show them)
      nodes = [n for n in ast.walk(ast.parse(text)) if isinstance(
          n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
      text = "\n".join(ast.get_docstring(n, clean=False) or "" for n in nodes)
    text = re.sub(r"\\\n\s*", " ", text)
    # An inline `command` the prose wraps onto the next line is one command.
    parts = re.split(r"(```.*?```)", text, flags=re.S)
    text = "".join(p if p.startswith("```") else
                   re.sub(r"`[^`]+`", lambda m: m.group(0).replace("\n", " "), p) for p in parts)
    for m in re.finditer(r"python3? (-m rloo_jax\.\w+|experiments/\w+\.py)([^`|#\n]*)", text):
      found.append((path, m.group(1), m.group(2)))
  return found


COMMANDS = _commands()


@functools.lru_cache(maxsize=None)
def _absl_flags(source: str) -> frozenset:
  """The names a module defines with absl's DEFINE_* (read from its source: importing two entry
  points would define --config twice in absl's global flags)."""
  names = set()
  for node in ast.walk(ast.parse(open(os.path.join(REPO, source)).read())):
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
      f = node.func
      if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")).startswith("DEFINE"):
        names.add(node.args[0].value)
  return frozenset(names)


def _check_absl(source, args):
  names = _absl_flags(source) | ABSL_FLAGS
  for arg in args:
    name = arg[2:].split("=")[0].split(".")[0]
    assert name in names or (name[:2] == "no" and name[2:] in names), (
        f"{source} defines no flag --{name} (given as {arg})")


def _check_config(args):
  """The config file and overrides, parsed exactly as `config_flags` does for the CLI."""
  argv = ["prog"] + [a for a in args if a.split("=")[0].split(".")[0] == "--config"]
  if not any(a.startswith("--config=") for a in argv) or PLACEHOLDER.search(" ".join(argv)):
    return None  # no file named, or one the reader fills in
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  return fv.config


def _check_settings(config):
  """The settings' own checks (`experiment.validate_config`: each a one-line error), which need
  no devices; a hub id's files are not fetched here."""
  init = config.model.init_from
  if not init or os.path.isdir(init):
    experiment.validate_config(algorithms.resolve(config)[1])


class _Parsed(Exception):
  pass


def _check_argparse(script, args, monkeypatch, capsys):
  """Runs the script's own argument parsing with the doc's arguments, and stops there."""
  real = argparse.ArgumentParser.parse_args

  def parse_and_stop(self, argv=None, namespace=None):
    # A doc's flag by its whole name: a prefix argparse accepts today is ambiguous once a
    # script gains a flag that starts the same.
    self.allow_abbrev = False
    real(self, argv, namespace)
    raise _Parsed
  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
  monkeypatch.setattr(sys, "argv", [script] + args)
  monkeypatch.syspath_prepend(os.path.join(REPO, "experiments"))  # as `python experiments/x.py`
  environ = dict(os.environ)  # a script may set variables before its parsing
  try:
    for _ in range(10):
      try:
        runpy.run_path(os.path.join(REPO, script), run_name="__main__")
      except ModuleNotFoundError as e:  # a peer's script (torch, TRL, Tunix): its own venv's
        assert e.name and e.name.split(".")[0] not in ("rloo_jax", "jax"), e
        monkeypatch.setitem(sys.modules, e.name, mock.MagicMock())
        continue
      break
  except _Parsed:
    return
  except SystemExit as e:
    pytest.fail(f"{script} {' '.join(args)}: {capsys.readouterr().err.strip() or e}")
  finally:
    os.environ.clear()
    os.environ.update(environ)
  pytest.fail(f"{script} returned without parsing its arguments")


def test_the_docs_name_commands():
  programs = {p for _, p, _ in COMMANDS}
  assert {"-m rloo_jax.train", "-m rloo_jax.plan", "-m rloo_jax.export",
          "-m rloo_jax.winrate"} <= programs and len(COMMANDS) > 100


def test_every_pinned_jax_is_the_one_setup_py_holds():
  """A jax (or jaxlib, or its TPU or CUDA package) pinned anywhere, the extras, constraints.txt or
  an install line of the docs and notebooks, is the lower bound of setup.py's jax range (the
  version the suite passes on): a later bump of that range cannot leave a doc installing another."""
  setup = open(os.path.join(REPO, "setup.py")).read()
  held = re.search(r'"jax>=([\d.]+),<[\d.]+"', setup).group(1)
  pins = {}
  for path in ["setup.py", "constraints.txt", "README.md"] + sorted(
      glob.glob("docs/*.md", root_dir=REPO) + glob.glob("notebooks/*.ipynb", root_dir=REPO)):
    for m in re.finditer(r"\bjax(?:lib|-cuda12-\w+)?(?:\[\w+\])?==([\d.]+)",
                         open(os.path.join(REPO, path)).read()):
      pins.setdefault(path, set()).add(m.group(1))
  assert {"setup.py", "constraints.txt", "notebooks/quickstart.ipynb"} <= set(pins), pins
  assert all(found == {held} for found in pins.values()), (held, pins)
  # A notebook's own install of jax's accelerator build names a version: `pip install -U
  # jax[cuda12]` would take the newest jax, outside setup.py's range.
  for path in glob.glob("notebooks/*.ipynb", root_dir=REPO):
    with open(os.path.join(REPO, path)) as f:
      code = "".join("".join(c["source"]) for c in json.load(f)["cells"]
                     if c["cell_type"] == "code")
    unpinned = [m.group(0) for m in re.finditer(r"jax\[[^\]]*\](?!==)", code)]
    assert not unpinned, (path, unpinned)


@pytest.mark.parametrize("doc,program,rest", COMMANDS,
                         ids=[f"{d}:{p.split('/')[-1]}:{i}" for i, (d, p, _) in
                              enumerate(COMMANDS)])
def test_a_documented_command_parses(doc, program, rest, monkeypatch, capsys):
  # A usage line's [--optional flags]; a value's own brackets (`=[1,2]`) stay.
  args = [a[1:] if a.startswith("[--") else a for a in shlex.split(rest) if a not in "[]"]
  args = [a[:-1] if a.endswith("]") and "[" not in a else a for a in args]
  flags_given = [a for a in args if a.startswith("--")]
  if program.startswith("-m "):
    _check_absl(program[3:].replace(".", "/") + ".py", flags_given)
    config = _check_config(flags_given)
    if config is not None and program in ("-m rloo_jax.train", "-m rloo_jax.plan"):
      _check_settings(config)
    return
  assert os.path.exists(os.path.join(REPO, program)), f"{doc} runs {program}, which is gone"
  source = open(os.path.join(REPO, program)).read()
  if not args:
    return  # the script named in prose, not a command
  if "argparse" in source:
    _check_argparse(program, [a for a in args if not PLACEHOLDER.search(a)], monkeypatch, capsys)
  elif "DEFINE" in source:
    _check_absl(program, flags_given)
    _check_config(flags_given)
  else:  # run_notebook.py: its one argument names a notebook
    for name in args:
      assert os.path.exists(os.path.join(REPO, "notebooks", f"{name}.ipynb")), (doc, name)


def _requirements():
  """setup.py's install_requires and its test and hf extras, as written."""
  call = next(n for n in ast.walk(ast.parse(open(os.path.join(REPO, "setup.py")).read()))
              if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
  kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords
        if k.arg in ("install_requires", "extras_require")}
  return kw["install_requires"] + kw["extras_require"]["test"] + kw["extras_require"]["hf"]


def test_every_requirement_has_the_lower_bound_readme_measured():
  """Each requirement has a lower bound (pip keeps any preinstalled version that meets it, and
  `--resolution lowest-direct` takes it), and README's lowest-versions install names those
  bounds: a bound raised or lowered without rerunning that measurement fails here."""
  bounds = {}
  for req in _requirements():
    m = re.match(r"([A-Za-z0-9_.-]+)(?:\[\w+\])?\s*(?:>=|==)\s*([\w.+]+)", req)
    assert m, f"setup.py: {req!r} has no lower bound"
    bounds[m.group(1).lower().replace("_", "-")] = m.group(2)
  readme = open(os.path.join(REPO, "README.md")).read()
  para = readme[readme.index("--resolution lowest-direct"):]
  para = para[:para.index("Below those bounds")]  # then the versions that failed
  named = {n.lower().replace("_", "-"): v
           for n, v in re.findall(r"\b([a-z][\w-]*) (\d+\.\d+\.\d+)\b", para)}
  assert len(named) >= 10 and set(named) <= set(bounds), (named, set(named) - set(bounds))
  version = lambda v: tuple(int(x) for x in v.split("+")[0].split(".")) + (0,) * 2
  assert {n: version(v)[:3] for n, v in named.items()} == \
      {n: version(bounds[n])[:3] for n in named}, (named, bounds)
