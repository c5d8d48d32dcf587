"""Routes for encoder models: POST /v1/classify (labels and probabilities) and /v1/embeddings (OpenAI's shape,
float or base64)."""

import base64

import numpy as np
from fastapi import APIRouter, Depends, Request

from serve.http import schemas as S
from serve.http.auth import allow, share, tenant
from serve.http.disconnect import while_connected
from serve.http.limits import check_texts
from serve.http.state import State
from serve.http.usage import input_usage
from serve.store.manifest import TenantEntry

router = APIRouter()


@router.post("/v1/classify", response_model=S.ClassifyResponse)
async def classify(body: S.ClassifyRequest, request: Request, state: State,
                   t: TenantEntry | None = Depends(tenant)):
    allow(request, t, body.model)
    texts = [body.input] if isinstance(body.input, str) else body.input
    check_texts(state.limits, texts)
    with state.tenant_gate.admit(t) as ticket:
        res = await while_connected(request, state.backend.classify(body.model, texts, body.truncate, share(t)))
        ticket.tokens = res.prompt_tokens
    data = [S.Classification(index=i, label=res.labels[int(np.argmax(row))], probs=dict(zip(res.labels, row)))
            for i, row in enumerate(res.probs)]
    return S.ClassifyResponse(model=body.model, data=data, usage=input_usage(res))


@router.post("/v1/embeddings", response_model=S.EmbeddingResponse)
async def embeddings(body: S.EmbeddingRequest, request: Request, state: State,
                     t: TenantEntry | None = Depends(tenant)):
    allow(request, t, body.model)
    texts = [body.input] if isinstance(body.input, str) else body.input
    check_texts(state.limits, texts)
    with state.tenant_gate.admit(t) as ticket:
        result = await while_connected(request, state.backend.embed(body.model, texts, body.truncate, share(t)))
        ticket.tokens = result.prompt_tokens
    vectors = np.asarray(result.vectors, dtype=np.float32)
    if body.encoding_format == "base64":
        data = [S.Embedding(index=i, embedding=base64.b64encode(v.astype("<f4").tobytes()).decode())
                for i, v in enumerate(vectors)]
    else:
        data = [S.Embedding(index=i, embedding=v.tolist()) for i, v in enumerate(vectors)]
    return S.EmbeddingResponse(data=data, model=body.model, usage=input_usage(result))
