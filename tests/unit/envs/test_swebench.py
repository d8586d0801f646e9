"""SWE-bench-format instances (``sao_jax/data/swebench.py``): a hand-made instance with a
repository snapshot folder, SWE-bench's string-encoded test lists, a ``test_patch`` and a gold
``patch``; grading by running the named tests in the sandbox backend."""

import json
import os

import pytest

from sao_jax.data import swebench
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.workspace import SandboxBackend, grade

BACKEND = SandboxBackend(SandboxLimits(cpu_s=2, wall_s=6.0), test_timeout_s=2.0)

GOLD = """diff --git a/textutil/words.py b/textutil/words.py
--- a/textutil/words.py
+++ b/textutil/words.py
@@ -1,4 +1,4 @@
 def count_words(text):
   \"\"\"Number of whitespace-separated words.\"\"\"
-  return len(text.split(" "))
+  return len(text.split())
 
"""
TEST_PATCH = """diff --git a/tests/test_words.py b/tests/test_words.py
--- a/tests/test_words.py
+++ b/tests/test_words.py
@@ -3,3 +3,7 @@ from textutil.words import count_words
 
 def test_simple():
   assert count_words("a b c") == 3
+
+
+def test_spaces():
+  assert count_words("  a   b ") == 2
"""


def _repo(root):
  (root / "textutil").mkdir(parents=True)
  (root / "textutil" / "__init__.py").write_text("")
  (root / "textutil" / "words.py").write_text(
      'def count_words(text):\n  """Number of whitespace-separated words."""\n'
      '  return len(text.split(" "))\n\n')
  (root / "tests").mkdir()
  (root / "tests" / "test_words.py").write_text(
      "from textutil.words import count_words\n\n\ndef test_simple():\n"
      '  assert count_words("a b c") == 3\n')
  (root / ".git").mkdir()
  (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
  (root / "blob.bin").write_bytes(b"\xff\xfe\x00")
  os.symlink("/etc/passwd", root / "passwd_link")


@pytest.fixture
def jsonl(tmp_path):
  _repo(tmp_path / "repos" / "textutil")
  row = {"instance_id": "textutil__textutil-1", "repo_path": "repos/textutil",
         "problem_statement": "count_words miscounts repeated spaces",
         "FAIL_TO_PASS": json.dumps(["tests/test_words.py::test_spaces"]),   # SWE-bench: a string
         "PASS_TO_PASS": ["tests/test_words.py::test_simple"],
         "test_patch": TEST_PATCH, "patch": GOLD}
  path = tmp_path / "instances.jsonl"
  path.write_text(json.dumps(row) + "\n\n")
  return path


def test_hand_made_instance_loads_from_a_snapshot_folder(jsonl):
  (inst,) = swebench.load_instances(jsonl)
  assert inst.instance_id == "textutil__textutil-1"
  assert inst.fail_to_pass == ("tests/test_words.py::test_spaces",)
  assert inst.pass_to_pass == ("tests/test_words.py::test_simple",)
  # text files only: no .git, no binary file, no symlink
  assert sorted(inst.files) == ["tests/test_words.py", "textutil/__init__.py",
                                "textutil/words.py"]
  # the test patch becomes hidden test files; the snapshot keeps the old test
  assert list(inst.test_files) == ["tests/test_words.py"]
  assert "test_spaces" in inst.test_files["tests/test_words.py"]
  assert "test_spaces" not in inst.files["tests/test_words.py"]


def test_grading_runs_the_named_tests_gold_resolves_and_the_snapshot_does_not(jsonl):
  (inst,) = swebench.load_instances(jsonl)
  r, info = grade(inst, dict(inst.files), BACKEND)
  assert r == 0.0 and info["tests"] == {"tests/test_words.py::test_spaces": "failed",
                                        "tests/test_words.py::test_simple": "passed"}
  gold = swebench.gold_files(inst)
  assert gold["textutil/words.py"].endswith("return len(text.split())\n\n")
  r, info = grade(inst, gold, BACKEND)
  assert r == 1.0 and info["resolved"] and set(info["tests"].values()) == {"passed"}


def test_inline_instances_round_trip(tmp_path, jsonl):
  (inst,) = swebench.load_instances(jsonl)
  out = tmp_path / "inline.jsonl"
  swebench.write_instances(out, [inst])
  (back,) = swebench.load_instances(out)
  assert back == inst


@pytest.mark.parametrize("change, message", [
    ({"files": {"a.py": ""}}, "exactly one of 'repo_path'"),
    ({"instance_id": 3}, "'instance_id'"),
    ({"FAIL_TO_PASS": "not json"}, "FAIL_TO_PASS is a string that is not a JSON list"),
    ({"FAIL_TO_PASS": [], "PASS_TO_PASS": []}, "both empty"),
    ({"test_patch": "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"},
     "patch does not apply"),
    ({"test_files": {"../evil.py": "x"}}, "must be relative"),
])
def test_bad_records_name_the_field(jsonl, change, message):
  row = json.loads(jsonl.read_text().splitlines()[0])
  row.update(change)
  jsonl.write_text(json.dumps(row) + "\n")
  with pytest.raises(ValueError, match=message) as e:
    swebench.load_instances(jsonl)
  assert str(e.value).startswith(f"{jsonl}:1: ")


def test_a_patch_cannot_write_outside_its_folder(tmp_path):
  evil = ("diff --git a/../../evil.py b/../../evil.py\nnew file mode 100644\n--- /dev/null\n"
          "+++ b/../../evil.py\n@@ -0,0 +1 @@\n+x = 1\n")
  with pytest.raises(ValueError, match="patch does not apply"):
    swebench.apply_patch({"a.py": "a\n"}, evil)
  assert not (tmp_path.parent / "evil.py").exists()


def test_is_test_path():
  assert all(map(swebench.is_test_path, ["tests/x.py", "test_a.py", "pkg/a_test.py",
                                         "conftest.py", "pkg/test/util.py"]))
  assert not any(map(swebench.is_test_path, ["pkg/a.py", "testing.py", "contest.py"]))
