"""The package's shape: no import cycles among rloo_jax modules (top-level and function-level
imports alike), no oversized files, and no trace of the removed activation-replay option."""
import ast
import os


from conftest import REPO

PACKAGE = "rloo_jax"
ROOT = os.path.join(REPO, PACKAGE)
MAX_LINES = 400
# Spelled in two halves so that this file does not find itself.
REMOVED_OPTION = "reuse_rollout" + "_activations"
SEARCHED_DIRS = ("rloo_jax", "configs", "tests", "experiments")


def _walk(root):
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
    for name in sorted(filenames):
      yield os.path.join(dirpath, name)


def module_files(root=ROOT, package=PACKAGE) -> dict[str, str]:
  """{dotted module name: path} of every .py file of the package (a package is its __init__)."""
  out = {}
  for path in _walk(root):
    if not path.endswith(".py"):
      continue
    parts = os.path.relpath(path, root)[:-3].split(os.sep)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join([package] + parts)] = path
  return out


def imported_modules(tree: ast.AST, module: str, is_package: bool, modules) -> set[str]:
  """The package modules an AST imports, wherever the import statement sits (module level,
  functions, classes, branches). `from a.b import c` names the module a.b.c when c is one,
  otherwise a.b (whose __init__ defines c)."""
  out = set()

  def add(name):
    # The longest prefix that is a module of the package: `import rloo_jax.x.y` -> rloo_jax.x.y.
    parts = name.split(".")
    while parts:
      candidate = ".".join(parts)
      if candidate in modules:
        out.add(candidate)
        return
      parts.pop()

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
          add(alias.name)
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative: from the module's own package, `level - 1` packages up
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level > 1:
          base = base[:-(node.level - 1)]
        base = ".".join(base + ([node.module] if node.module else []))
      else:
        base = node.module or ""
      if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
        continue
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
          out.add(sub)
        else:
          add(base)
  out.discard(module)  # a package importing its own names is no edge
  return out


def import_graph(root=ROOT, package=PACKAGE) -> dict[str, set[str]]:
  modules = module_files(root, package)
  graph = {}
  for name, path in modules.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), filename=path)
    graph[name] = imported_modules(tree, name, path.endswith("__init__.py"), modules)
  return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One concrete cycle [a, b, ..., a] for every strongly connected component of the graph that
  has one (Tarjan's algorithm, iterative; a self-loop counts)."""
  index, low, on_stack, stack, sccs = {}, {}, set(), [], []
  counter = 0
  for start in sorted(graph):
    if start in index:
      continue
    work = [(start, iter(sorted(graph.get(start, ()))))]
    index[start] = low[start] = counter
    counter += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter
          counter += 1
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph.get(child, ())))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        parent = work[-1][0]
        low[parent] = min(low[parent], low[node])
      if low[node] == index[node]:
        scc = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          scc.append(member)
          if member == node:
            break
        if len(scc) > 1 or node in graph.get(node, ()):
          sccs.append(set(scc))
  cycles = []
  for scc in sccs:
    first = min(scc)
    # Breadth-first from `first` back to itself inside the component: the shortest cycle.
    parents, frontier, found = {}, [first], None
    while frontier and found is None:
      nxt = []
      for node in frontier:
        for child in sorted(graph.get(node, ())):
          if child not in scc:
            continue
          if child == first:
            found = node
            break
          if child not in parents:
            parents[child] = node
            nxt.append(child)
        if found is not None:
          break
      frontier = nxt
    path, node = [first], found
    while node != first:
      path.append(node)
      node = parents[node]
    cycles.append([first] + path[1:][::-1] + [first])
  return sorted(cycles)


# ----------------------------------------------------------------------------------------------
# The cycle finder itself (so the package test can fail)


def test_find_cycles_on_synthetic_graphs():
  assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
  assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
  assert find_cycles({"a": {"a"}}) == [["a", "a"]]
  two = find_cycles({"a": {"b"}, "b": {"a"}, "x": {"y"}, "y": {"z"}, "z": {"x", "a"}})
  assert two == [["a", "b", "a"], ["x", "y", "z", "x"]]
  # Shortest cycle through the component's first module, among longer ones.
  assert find_cycles({"a": {"b", "d"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "d", "a"]]
  # Deep chains do not hit the recursion limit.
  chain = {str(i).zfill(5): {str(i + 1).zfill(5)} for i in range(5000)}
  chain["05000"] = {"00000"}
  assert len(find_cycles(chain)[0]) == 5002


def test_import_edges_of_every_import_form(tmp_path):
  pkg = tmp_path / PACKAGE
  (pkg / "sub").mkdir(parents=True)
  files = {
      "__init__.py": "from rloo_jax import a  # noqa\n",
      "a.py": "import rloo_jax.b\nimport os\n",
      "b.py": "def f():\n  from rloo_jax.sub import c  # function level\n",
      "sub/__init__.py": "from .c import NAME\n",
      "sub/c.py": "from ..d import thing\nNAME = 1\n",
      "d.py": "from rloo_jax.sub import NAME\nthing = 1\nfrom . import e\n",
      "e.py": "from rloo_jax import sub\nimport numpy\n",
  }
  for name, text in files.items():
    (pkg / name).write_text(text)
  graph = import_graph(str(pkg), PACKAGE)
  assert graph == {
      "rloo_jax": {"rloo_jax.a"},
      "rloo_jax.a": {"rloo_jax.b"},
      "rloo_jax.b": {"rloo_jax.sub.c"},
      "rloo_jax.sub": {"rloo_jax.sub.c"},
      "rloo_jax.sub.c": {"rloo_jax.d"},
      "rloo_jax.d": {"rloo_jax.sub", "rloo_jax.e"},
      "rloo_jax.e": {"rloo_jax.sub"},
  }
  assert find_cycles(graph) == [["rloo_jax.d", "rloo_jax.sub", "rloo_jax.sub.c", "rloo_jax.d"]]


# ----------------------------------------------------------------------------------------------
# The package


def test_the_package_import_graph_has_no_cycle():
  graph = import_graph()
  assert "rloo_jax.experiment" in graph and "rloo_jax.loop" in graph["rloo_jax.algorithms"]
  cycles = find_cycles(graph)
  assert not cycles, "import cycles among rloo_jax modules:\n" + "\n".join(
      " -> ".join(c) for c in cycles)


def test_no_file_in_the_package_is_too_long():
  too_long = {}
  for path in _walk(ROOT):
    try:
      with open(path, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    except UnicodeDecodeError:
      continue  # not text
    if n > MAX_LINES:
      too_long[os.path.relpath(path, REPO)] = n
  assert not too_long, f"files over {MAX_LINES} lines (split them): {too_long}"


def test_the_removed_activation_replay_option_is_gone():
  hits = []
  needle = REMOVED_OPTION.encode()
  for d in SEARCHED_DIRS:
    for path in _walk(os.path.join(REPO, d)):
      with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
          if needle in line:
            hits.append(f"{os.path.relpath(path, REPO)}:{lineno}")
  assert not hits, f"{REMOVED_OPTION} is still mentioned at: {hits}"
