"""Task readers: real files in tmp_path, a real environment service over real HTTP, no engine."""

from __future__ import annotations

import ast
import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from harness.core.records import Task
from harness.running.tasks import TaskError, evaluate_instance, instance_for, read_tasks
from tests.support import BackgroundApp

ROOT = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# ---------------------------------------------------------------------------------------------------------------
# JSONL


def test_jsonl_ids_come_from_id_or_task_id_else_the_line_number(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"id": "a", "prompt": "p1"}, "", {"task_id": 7, "prompt": "p2"},
                                                   "   ", {"prompt": "p3"}])
    tasks = read_tasks(str(path))
    assert tasks == [Task("a", {"id": "a", "prompt": "p1"}, "train"), Task("7", {"task_id": 7, "prompt": "p2"}),
                     Task("line-5", {"prompt": "p3"})]


def test_jsonl_malformed_line_names_the_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"id": "a"}, '{"id": "b" "prompt": 1}'])
    with pytest.raises(TaskError) as err:
        read_tasks(str(path))
    assert str(err.value) == f"{path} line 2: not valid JSON (Expecting ',' delimiter: column 12)"


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"id": "a"}, [1, 2]])
    with pytest.raises(TaskError, match=r"tasks.jsonl line 2: expected a JSON object .*got a list"):
        read_tasks(str(path))


def test_jsonl_duplicate_ids_name_both_lines(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"id": "a"}, {"id": "b"}, {"id": "a"}])
    with pytest.raises(TaskError, match=r"task id 'a' is used twice, on line 1 and on line 3"):
        read_tasks(str(path))


def test_jsonl_bad_id_is_named(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"id": None}])
    with pytest.raises(TaskError, match=r"line 1: 'id' must be a non-empty string or an integer, got None"):
        read_tasks(str(path))


def test_jsonl_split_field_selects_and_lines_without_one_are_train(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"id": "a"}, {"id": "b", "split": "validation"},
                                                   {"id": "c", "split": "train"}, {"id": "d", "split": "validation"}])
    assert [t.task_id for t in read_tasks(str(path))] == ["a", "c"]
    validation = read_tasks(str(path), split="validation")
    assert [(t.task_id, t.split) for t in validation] == [("b", "validation"), ("d", "validation")]
    with pytest.raises(TaskError, match=r"no tasks in split 'test' \(its splits: 'train', 'validation'\)"):
        read_tasks(str(path), split="test")


def test_limit_takes_the_first_tasks_of_the_split(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"id": str(i), "split": "train" if i % 2 else "validation"}
                                                   for i in range(10)])
    assert [t.task_id for t in read_tasks(path, limit=3)] == ["1", "3", "5"]
    assert read_tasks(path, limit=0) == []
    assert len(read_tasks(path, limit=100)) == 5
    with pytest.raises(TaskError, match="limit must be a number >= 0"):
        read_tasks(path, limit=-1)


def test_limit_does_not_hide_a_broken_line_further_down(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"id": "a"}, {"id": "b"}, "not json"])
    with pytest.raises(TaskError, match="line 3: not valid JSON"):
        read_tasks(str(path), limit=1)


def test_empty_jsonl_gives_no_tasks(tmp_path):
    (tmp_path / "tasks.jsonl").write_text("\n\n")
    assert read_tasks(str(tmp_path / "tasks.jsonl")) == []


def test_the_example_tasks_file_reads():
    tasks = read_tasks(str(ROOT / "examples" / "tasks.jsonl"))
    assert tasks and all(t.split == "train" for t in tasks)


# ---------------------------------------------------------------------------------------------------------------
# Sources that are not there or not understood


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(TaskError, match=f"no such file or directory: {tmp_path / 'nope.jsonl'}"):
        read_tasks(str(tmp_path / "nope.jsonl"))
    with pytest.raises(TaskError, match="no such file or directory: data/nope.parquet"):
        read_tasks("data/nope.parquet")


def test_unknown_forms_list_the_accepted_ones(tmp_path):
    (tmp_path / "tasks.csv").write_text("id,prompt\na,b\n")
    with pytest.raises(TaskError, match=r"files ending in '.csv' are not a task format. Accepted: a .jsonl file"):
        read_tasks(str(tmp_path / "tasks.csv"))
    for source in ("ftp://example.com/tasks", "what are these tasks?"):
        with pytest.raises(TaskError, match=r"can't tell what kind of task source .* Accepted: a .jsonl file"):
            read_tasks(source)


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face datasets


@pytest.fixture
def datasets(tmp_path, monkeypatch):
    """The datasets package, caching into tmp_path rather than ~/.cache."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    datasets.disable_progress_bars()
    return datasets


def test_save_to_disk_dataset_dict_picks_the_split(tmp_path, datasets):
    train = datasets.Dataset.from_list([{"id": "t1", "question": "1+1", "answer": "2"},
                                        {"id": "t2", "question": "2+2", "answer": "4"}])
    validation = datasets.Dataset.from_list([{"id": "v1", "question": "3+3", "answer": "6"}])
    datasets.DatasetDict({"train": train, "validation": validation}).save_to_disk(str(tmp_path / "saved"))

    tasks = read_tasks(str(tmp_path / "saved"))
    assert tasks == [Task("t1", {"id": "t1", "question": "1+1", "answer": "2"}, "train"),
                     Task("t2", {"id": "t2", "question": "2+2", "answer": "4"}, "train")]
    assert [(t.task_id, t.split) for t in read_tasks(tmp_path / "saved", split="validation")] == [("v1", "validation")]
    assert [t.task_id for t in read_tasks(tmp_path / "saved", limit=1)] == ["t1"]
    with pytest.raises(TaskError, match=r"saved has no tasks in split 'test' \(its splits: 'train', 'validation'\)"):
        read_tasks(str(tmp_path / "saved"), split="test")


def test_a_saved_single_dataset_keeps_its_own_split(tmp_path, datasets):
    one = datasets.Dataset.from_list([{"q": "a"}, {"q": "b"}], split=datasets.Split.VALIDATION)
    one.save_to_disk(str(tmp_path / "one"))  # a bare Dataset, not a DatasetDict; it remembers its split
    assert [(t.task_id, t.split) for t in read_tasks(tmp_path / "one", split="validation")] == [
        ("row-0", "validation"), ("row-1", "validation")]
    with pytest.raises(TaskError, match=r"holds one split, 'validation', .*pass split='validation'"):
        read_tasks(tmp_path / "one")


def test_parquet_file(tmp_path, datasets):
    rows = [{"task_id": f"p{i}", "prompt": f"what is {i}+{i}?", "answer": 2 * i} for i in range(5)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "tasks.parquet"))
    tasks = read_tasks(str(tmp_path / "tasks.parquet"), limit=3)
    assert tasks == [Task(r["task_id"], r, "train") for r in rows[:3]]
    with pytest.raises(TaskError, match=r"holds one split, 'train', and no \"split\" column"):
        read_tasks(str(tmp_path / "tasks.parquet"), split="validation")


def test_json_file_ids_are_row_indexes_and_a_split_column_selects(tmp_path, datasets):
    rows = [{"prompt": "a", "split": "train"}, {"prompt": "b", "split": "validation"}, {"prompt": "c", "split": None}]
    (tmp_path / "tasks.json").write_text(json.dumps(rows))
    assert [(t.task_id, t.data["prompt"]) for t in read_tasks(str(tmp_path / "tasks.json"))] == [
        ("row-0", "a"), ("row-2", "c")]
    assert [t.task_id for t in read_tasks(str(tmp_path / "tasks.json"), split="validation")] == ["row-1"]


def test_directory_of_parquet_files_splits_by_file_name(tmp_path, datasets):
    (tmp_path / "data").mkdir()
    datasets.Dataset.from_list([{"id": "a"}, {"id": "b"}]).to_parquet(str(tmp_path / "data" / "train.parquet"))
    datasets.Dataset.from_list([{"id": "c"}]).to_parquet(str(tmp_path / "data" / "validation.parquet"))
    assert [t.task_id for t in read_tasks(str(tmp_path / "data"))] == ["a", "b"]
    assert [t.task_id for t in read_tasks(str(tmp_path / "data"), split="validation")] == ["c"]


def test_directory_in_hub_layout_with_shards_and_custom_splits(tmp_path, datasets):
    data = tmp_path / "gsm" / "data"
    data.mkdir(parents=True)
    for name, ids in [("train-00000-of-00002.parquet", ["a"]), ("train-00001-of-00002.parquet", ["b"]),
                      ("hard-00000-of-00001.parquet", ["h"])]:
        datasets.Dataset.from_list([{"id": i, "split": "ignored"} for i in ids]).to_parquet(str(data / name))
    (tmp_path / "gsm" / "dev").mkdir()
    (tmp_path / "gsm" / "dev" / "part.jsonl").write_text('{"id": "d"}\n')
    source = str(tmp_path / "gsm")
    assert [t.task_id for t in read_tasks(source)] == ["a", "b"]  # the files chose the split, not the column
    assert [t.task_id for t in read_tasks(source, split="hard")] == ["h"]
    assert [t.task_id for t in read_tasks(source, split="validation")] == ["d"]  # "dev" is validation, as on the Hub
    with pytest.raises(TaskError, match=r"gsm has no tasks in split 'test' \(its splits: 'hard', 'train', 'valid"):
        read_tasks(source, split="test")


def test_directory_without_data_is_refused_without_walking_it(tmp_path, datasets):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match=r"empty is a directory, but neither one saved with datasets' save_to_disk"):
        read_tasks(str(tmp_path / "empty"))
    project = tmp_path / "project"  # a project root passed by mistake: data files only deep inside hidden folders
    (project / ".venv" / "lib").mkdir(parents=True)
    (project / ".venv" / "lib" / "meta.json").write_text("{}")
    (project / "src" / "pkg" / "deep" / "deeper").mkdir(parents=True)
    (project / "src" / "pkg" / "deep" / "deeper" / "config.json").write_text("{}")
    with pytest.raises(TaskError, match=r"holding data files \(.arrow, .json, .jsonl, .parquet\) in it or two"):
        read_tasks(str(project))


def test_empty_source_is_not_the_current_directory():
    with pytest.raises(TaskError, match=r"no task source given \(got ''\). Accepted:"):
        read_tasks("")


def test_broken_parquet_file_names_it(tmp_path, datasets):
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(TaskError, match=r"broken.parquet can't be read as parquet"):
        read_tasks(str(tmp_path / "broken.parquet"))


def test_hub_name_while_offline_says_so_quickly(datasets, monkeypatch):
    # The Hub's address is the edge: point it at a port where nothing listens, as an offline machine would see it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    started = time.monotonic()
    with pytest.raises(TaskError) as err:
        read_tasks("openai/gsm8k:main")
    assert time.monotonic() - started < 5
    message = str(err.value)
    assert "'openai/gsm8k:main' is not a local file or directory" in message
    assert "can't be reached from this machine" in message and "looks offline" in message
    assert "pass a local path instead" in message


def test_hub_name_in_offline_mode_not_in_the_cache(datasets, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TaskError, match=r"can't load dataset 'someone/no-such-dataset': offline mode is on"):
        read_tasks("someone/no-such-dataset")


def test_missing_datasets_package_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "tasks.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an environment without the extra looks like
    with pytest.raises(TaskError, match=r"needs the 'datasets' package: pip install -e '\.\[data\]' in the harness"):
        read_tasks(str(tmp_path / "tasks.parquet"))


# ---------------------------------------------------------------------------------------------------------------
# Environment service (examples/env_service), over real HTTP


def test_env_service_lists_the_tasks_of_each_split(env_url):
    train = read_tasks(env_url)
    assert [t.task_id for t in train][:2] == ["add-17-25", "mul-6-7"] and len(train) == 6
    assert train[0] == Task("add-17-25", {"task_id": "add-17-25", "prompt": "What is 17 plus 25?",
                                          "env_url": env_url}, "train")
    validation = read_tasks(env_url + "/", split="validation", limit=2)
    assert [(t.task_id, t.split) for t in validation] == [("add-123-456", "validation"), ("mul-12-12", "validation")]
    assert all(t.data["env_url"] == env_url for t in validation)


def test_env_service_unknown_split_is_an_error_with_the_services_message(env_url):
    with pytest.raises(TaskError) as err:
        read_tasks(env_url, split="test")
    assert str(err.value) == (f"GET {env_url}/tasks?split=test answered HTTP 404: "
                              "no split 'test'; this service has: train, validation")


def test_instance_for_creates_a_fresh_instance_per_call(env_url):
    task = read_tasks(env_url)[0]
    first, second = instance_for(task), instance_for(task)
    assert first["prompt"] == "What is 17 plus 25?" and first["task_id"] == "add-17-25"
    assert first["env_url"] == env_url
    assert first["instance_id"] != second["instance_id"]


def test_evaluate_instance_scores_right_and_wrong_answers(env_url):
    task = read_tasks(env_url, split="validation")[2]  # 7 minus 19
    instance = instance_for(task)
    right = evaluate_instance(env_url, instance["instance_id"], "7 - 19 = -12, so the answer is -12.")
    assert right == {"reward": 1.0, "details": {"task_id": "sub-7-19", "expected": -12, "got": -12.0,
                                                 "evaluations": 1}}
    wrong = evaluate_instance(env_url, instance["instance_id"], "I think it is 12")
    assert wrong["reward"] == 0.0 and wrong["details"]["got"] == 12.0
    silent = evaluate_instance(env_url, instance["instance_id"], None)
    assert silent["reward"] == 0.0 and silent["details"]["reason"] == "no number in the answer"


def test_evaluate_unknown_instance_names_url_status_and_message(env_url):
    with pytest.raises(TaskError) as err:
        evaluate_instance(env_url, "nope", "42")
    assert str(err.value) == (f"POST {env_url}/instances/nope/evaluate answered HTTP 404: "
                              "no instance 'nope'; create one with POST /instances")


def test_instance_for_unknown_task_is_an_error(env_url):
    with pytest.raises(TaskError, match=r"/instances answered HTTP 404: no task 'ghost'"):
        instance_for(Task("ghost", {"env_url": env_url}))


def test_service_that_is_not_running(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TaskError, match=r"GET .*/tasks\?split=train failed .*is the environment service running"):
        read_tasks(url)


@pytest.fixture
def odd_service():
    """A service that breaks the protocol: plain-text errors, wrong shapes, and one route that never answers."""
    async def plain_error(request):
        return web.Response(status=500, text="Traceback (most recent call last): boom")

    async def wrong_shape(request):
        return web.json_response({"reward": "high"} if "evaluate" in request.path else [1, 2])

    async def silent(request):
        await asyncio.sleep(30)

    app = web.Application()
    app.router.add_get("/tasks", wrong_shape)
    app.router.add_post("/instances", plain_error)
    app.router.add_post("/instances/{id}/evaluate", wrong_shape)
    app.router.add_post("/slow/instances/{id}/evaluate", silent)
    served = BackgroundApp(app, shutdown_timeout=0.1)
    yield served.url
    served.close()


def test_a_service_that_breaks_the_protocol_is_named(odd_service):
    with pytest.raises(TaskError, match=r'/tasks\?split=train answered \[1, 2\]; expected {"tasks": \[...\]}'):
        read_tasks(odd_service)
    with pytest.raises(TaskError, match=r"POST .*/instances answered HTTP 500: Traceback \(most recent call last\)"):
        instance_for(Task("t", {"env_url": odd_service}))
    with pytest.raises(TaskError, match=r'answered {"reward": "high"}; expected .* finite number "reward"'):
        evaluate_instance(odd_service, "i-1", "42")
    started = time.monotonic()
    with pytest.raises(TaskError, match=r"POST .*/slow/instances/i-1/evaluate got no answer within 0.5 s"):
        evaluate_instance(odd_service + "/slow", "i-1", "42", timeout_s=0.5)
    assert time.monotonic() - started < 5


def test_example_service_imports_nothing_of_the_harness():
    tree = ast.parse((ROOT / "examples" / "env_service" / "service.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module}
    assert not imported & {"harness", "proxy", "trainer"}


def test_instance_for_gives_other_tasks_unchanged():
    data = {"prompt": "What is 6 times 7?", "answer": "42"}
    assert instance_for(Task("mul", data)) is data


# ---------------------------------------------------------------------------------------------------------------
# Python functions


TASKS_MODULE = '''
from harness.core.records import Task

def by_split(split):
    return [{"id": f"{split}-{i}", "prompt": str(i)} for i in range(3)]

def everything():
    yield {"prompt": "a"}
    yield {"prompt": "b", "split": "validation"}
    yield Task("c", {"prompt": "c"}, "validation")

def broken(split="train"):
    raise RuntimeError("the dataset server is down")

def wrong_items(split):
    return ["just a string"]

def needs_more(split, path):
    return []

NOT_A_FUNCTION = 3
'''


def test_function_in_a_file_gets_the_split(tmp_path):
    (tmp_path / "my_tasks.py").write_text(TASKS_MODULE)
    spec = f"{tmp_path / 'my_tasks.py'}:by_split"
    assert [(t.task_id, t.split) for t in read_tasks(spec, split="validation", limit=2)] == [
        ("validation-0", "validation"), ("validation-1", "validation")]


def test_function_without_arguments_is_filtered_by_split(tmp_path):
    (tmp_path / "my_tasks.py").write_text(TASKS_MODULE)
    spec = f"{tmp_path / 'my_tasks.py'}:everything"
    assert read_tasks(spec) == [Task("item-0", {"prompt": "a"}, "train")]
    assert [t.task_id for t in read_tasks(spec, split="validation")] == ["item-1", "c"]


def test_module_function_on_sys_path(tmp_path, monkeypatch):
    (tmp_path / "harness_test_tasks_mod.py").write_text(TASKS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "harness_test_tasks_mod", raising=False)
    assert [t.task_id for t in read_tasks("harness_test_tasks_mod:by_split")] == ["train-0", "train-1", "train-2"]


@pytest.mark.parametrize(("function", "message"), [
    ("missing", r"has no 'missing' \(its functions: broken, by_split, everything, needs_more, wrong_items\)"),
    ("NOT_A_FUNCTION", r"NOT_A_FUNCTION is a number, not a function"),
    ("broken", r"task function '.*my_tasks.py:broken' raised RuntimeError: the dataset server is down"),
    ("wrong_items", r"my_tasks.py:wrong_items' item 0 is a string; return dicts or harness.core.records.Task objects"),
    ("needs_more", r"must take a `split` keyword argument or no arguments; its signature is \(split, path\)"),
])
def test_bad_functions_are_named(tmp_path, function, message):
    (tmp_path / "my_tasks.py").write_text(TASKS_MODULE)
    with pytest.raises(TaskError, match=message):
        read_tasks(f"{tmp_path / 'my_tasks.py'}:{function}")


def test_bad_function_specs(tmp_path):
    with pytest.raises(TaskError, match=r"no such file: .*nowhere.py"):
        read_tasks(f"{tmp_path / 'nowhere.py'}:tasks")
    with pytest.raises(TaskError, match=r"no module named 'no_such_module_xyz'; install it or put it on sys.path"):
        read_tasks("no_such_module_xyz:tasks")
    (tmp_path / "syntax_error.py").write_text("def tasks(:\n")
    with pytest.raises(TaskError, match=r"running .*syntax_error.py raised SyntaxError"):
        read_tasks(f"{tmp_path / 'syntax_error.py'}:tasks")
