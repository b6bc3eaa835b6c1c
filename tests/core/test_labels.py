"""Label values from clients and backends stay within bounded sets."""

from __future__ import annotations

import pytest

from proxy.core.labels import MAX_MODELS, OTHER, HeaderLabels, ModelLabels, route_template


def test_unknown_model_is_other() -> None:
    assert ModelLabels()("gpt-4o") == OTHER


def test_allowlisted_model_is_its_own_label() -> None:
    assert ModelLabels(("llama", "qwen"))("qwen") == "qwen"


def test_model_listed_by_upstream_is_its_own_label() -> None:
    labels = ModelLabels()
    labels.update_from_upstream(["meta-llama/Llama-3.1-8B-Instruct"])
    assert labels("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"


def test_empty_model_is_other() -> None:
    assert ModelLabels(("llama",))("") == OTHER


def test_model_match_is_exact() -> None:
    labels = ModelLabels(("llama",))
    assert [labels("Llama"), labels("llama "), labels("llama2")] == [OTHER] * 3


def test_upstream_update_replaces_earlier_upstream_models() -> None:
    labels = ModelLabels()
    labels.update_from_upstream(["old"])
    labels.update_from_upstream(["new"])
    assert (labels("old"), labels("new")) == (OTHER, "new")


def test_allowlist_survives_an_upstream_update() -> None:
    labels = ModelLabels(("pinned",))
    labels.update_from_upstream([])
    assert labels("pinned") == "pinned"


def test_upstream_models_are_capped() -> None:
    labels = ModelLabels(("pinned",))
    labels.update_from_upstream([f"m{i}" for i in range(MAX_MODELS * 3)])
    assert len(labels.known) == MAX_MODELS
    assert "pinned" in labels.known


def test_allowlist_is_capped() -> None:
    labels = ModelLabels(tuple(f"a{i}" for i in range(MAX_MODELS + 50)))
    labels.update_from_upstream(["upstream"])
    assert len(labels.known) == MAX_MODELS
    assert labels("upstream") == OTHER


@pytest.mark.parametrize(
    ("path", "want"),
    [
        ("/v1/models", "/v1/models"),
        ("/v1/embeddings", "/v1/embeddings"),
        ("/v1/models/llama", "/v1/models/{model}"),
        ("/v1/files/file-abc123", "/v1/files/{id}"),
        ("/v1/files/file-abc123/content", "/v1/files/{id}"),
        ("/v1/batches/batch_1/cancel", "/v1/batches/{id}"),
        ("/v1/responses/resp_9", "/v1/responses/{id}"),
        ("/v1/unknown", "/v1/other"),
        ("/v1/embeddingsX", "/v1/other"),
        ("/v1", "/other"),
        ("/", "/other"),
        ("/tokenize", "/tokenize"),
        ("/v2/rerank", "/v2/rerank"),
        ("/v1/messages/count_tokens", "/v1/messages/count_tokens"),
        # vLLM 0.32's fixed sub-routes are their own, not their parent's {id} (a review)
        ("/v1/chat/completions/batch", "/v1/chat/completions/batch"),
        ("/v1/chat/completions/render", "/v1/chat/completions/render"),
        ("/v1/systemone", "/v1/systemone"),
        ("/generative_scoring", "/generative_scoring"),
        ("/admin/../../etc", "/other"),
    ],
)
def test_route_template(path: str, want: str) -> None:
    assert route_template(path) == want


def test_route_templates_stay_bounded_for_arbitrary_paths() -> None:
    paths = [f"/v1/{kind}/{i}/{i}" for kind in ("files", "x", "models", "a/b") for i in range(500)]
    paths += [f"/{kind}{i}/x" for kind in ("admin", "tokenize", "") for i in range(500)]
    templates = {route_template(p) for p in paths}
    assert templates <= {"/v1/files/{id}", "/v1/other", "/v1/models/{model}", "/other"}


def test_a_backend_that_ignores_names_labels_every_unvouched_name_its_one_model() -> None:
    """llama-server serves its one model whatever a request names (or none, as native
    /completion): that model answered, and is the label; a listed name stays its own."""
    labels = ModelLabels(("pinned",))
    labels.update_from_upstream(["tiny"])
    assert [labels(""), labels("gpt-4o")] == [OTHER, OTHER]  # until the backend is known
    labels.names_ignored(True)
    assert [labels(""), labels("gpt-4o"), labels("tiny"), labels("pinned")] == [
        "tiny",
        "tiny",
        "tiny",
        "pinned",
    ]
    labels.update_from_upstream(["a", "b"])  # routing between models: the name counts
    assert [labels(""), labels("a")] == [OTHER, "a"]
    labels.update_from_upstream(["tiny"])
    labels.names_ignored(False)  # another backend behind the same URL
    assert labels("") == OTHER


# -- attribution values shaped like a credential ------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        b"sk-CANARYLABELKEY77abcdef",  # a provider key sent in the label's header
        b"Bearer sk-CANARYLABELKEY77abcdef",
        b"bearer CANARYOPAQUETOKEN",  # an opaque bearer token: its scheme says it
        b"Basic dXNlcjpDQU5BUlk=",  # an Authorization header's value pasted whole
        b"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJDQU5BUlkifQ.c2ln",  # a JWT
        b"Bearer_sk-CANARYLABELKEY77",  # glued by the label's own stand-in for a space
        b"Bearer\x01CANARYOPAQUETOKEN",  # a character the label shows as "_" between
        b"sk_live_CANARY123456",  # Stripe's shape
        b"AKIAIOSFODNN7EXAMPLE",  # an AWS access key id
        b"team " + b"x" * 40 + b" sk-CANARYPASTTHECUT0123",  # its start within the 64 kept
        b"x" * 30 + b" eyJ" + b"h" * 300 + b".payload",  # a JWT whose first part is long
    ],
)
def test_a_credential_shaped_value_is_other_and_takes_no_place(value: bytes) -> None:
    labels = HeaderLabels(("x-team",), max_values=1)
    assert labels([(b"x-team", value)]) == (OTHER,)
    # no place taken: the one value allowed is still free for a real team
    assert labels([(b"x-team", b"red")]) == ("red",)


@pytest.mark.parametrize(
    "value",
    [b"red", b"team-a", b"data_science", b"risk-assessment", b"sk-short", b"sk_learn_model_v2",
     b"hf-internal-testing", b"basic", b"Token-ring", b"tenant:42/eu@west"],
)  # fmt: skip
def test_ordinary_values_keep_their_label(value: bytes) -> None:
    assert HeaderLabels(("x-team",), max_values=5)([(b"x-team", value)]) == (value.decode(),)
