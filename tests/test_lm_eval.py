"""lm-evaluation-harness against a served Baton stack scores what it scores on the HF model.

The harness (`lm-eval`, the PyPI package) runs two small tasks of our own (tests/lm_eval: a
local dataset, no hub): a loglikelihood task through `local-completions` (prompt logprobs via
echo) and a generate-until task through `local-chat-completions`; then the same tasks through
`--model hf` on the embedded model's converted checkpoint. The scores must be equal."""
from __future__ import annotations

import pytest
from cluster import REPO

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra (and the eval extra): "
                              "pip install '.[eval]'")

TASKS = REPO / "tests" / "lm_eval"
MODEL = "smollm2-135m-instruct"
CHOICE, ANSWER = "baton_capitals_choice", "baton_capitals_answer"
SCORES = {CHOICE: ("acc,none", "acc_norm,none"), ANSWER: ("exact_match,strip",)}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No hub: the datasets are local files, the tokenizer and weights the embedded model's."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(TASKS)                     # the task files name their data relative to it


def evaluate(model, task: str, **kw) -> tuple[dict, list]:
    """The task's scores, and each document's raw answers (log-likelihoods, or generated text)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    # only our tasks: indexing lm-eval's thousands of built-in task files takes ~15 s a call
    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)
    out = simple_evaluate(model=model, tasks=[task], task_manager=tasks,
                          random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
                          log_samples=True, **kw)
    answers = [s["resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]
    return {k: float(out["results"][task][k]) for k in SCORES[task]}, answers


def test_served_scores_equal_the_hf_models(pd_cluster, embedded_source):
    """Served by the session's router + prefill + decode stack (separate processes)."""
    from lm_eval.models.huggingface import HFLM
    path = embedded_source.tokenizer_dir()              # the converted checkpoint: weights and tokenizer
    api = dict(model=MODEL, tokenizer_backend="huggingface", tokenizer=path, num_concurrent=4, max_retries=1,
               tokenized_requests=True)
    base = pd_cluster.http_url
    served = {
        CHOICE: evaluate("local-completions", CHOICE, model_args=dict(api, base_url=base + "/completions")),
        ANSWER: evaluate("local-chat-completions", ANSWER, apply_chat_template=True,
                         model_args=dict(api, base_url=base + "/chat/completions", tokenized_requests=False)),
    }
    hf = HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=8)
    reference = {CHOICE: evaluate(hf, CHOICE), ANSWER: evaluate(hf, ANSWER, apply_chat_template=True)}
    print("served:", {t: v[0] for t, v in served.items()}, "hf:", {t: v[0] for t, v in reference.items()})
    assert {t: v[0] for t, v in served.items()} == {t: v[0] for t, v in reference.items()}
    assert served[CHOICE][0]["acc,none"] > 0.5 and served[ANSWER][0]["exact_match,strip"] > 0.5   # no chance agreement
    # document by document: each choice's log-likelihood (to float tolerance) and greediness, each answer's text
    for mine, theirs in zip(served[CHOICE][1], reference[CHOICE][1], strict=True):
        assert [g for [(_, g)] in mine] == [g for [(_, g)] in theirs]
        assert [ll for [(ll, _)] in mine] == pytest.approx([ll for [(ll, _)] in theirs], abs=2e-3)
    assert served[ANSWER][1] == reference[ANSWER][1]
