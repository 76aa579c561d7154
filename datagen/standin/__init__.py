"""CPU stand-in for SGLang 0.5.23's HTTP server: `python -m datagen.standin <sglang flags>`.

No GPU exists in CI, so the pipeline launches this instead of `python -m sglang.launch_server`, with
the same flags. It loads the tokenizer and chat template from `--model-path`, keeps the port closed
while "loading", answers /health 503 during warmup, then serves SGLang's API (/generate,
/v1/chat/completions, /server_info, /v1/loads, /metrics, ...) with synthetic Qwen3.6-style outputs
over the real vocabulary (`reasoning\\n</think>\\n\\nanswer<|im_end|>`), deterministic per
(input ids, sampling_seed), and a continuous-batching timing model so throughput can be benchmarked.

Environment knobs (all optional; defaults keep tests fast):

    DATAGEN_STANDIN_LOAD_S              seconds the port stays closed while "loading" (0.5; tokenizer load counts)
    DATAGEN_STANDIN_WARMUP_S            seconds /health and /ready answer 503 after the port opens (0.5);
                                        --skip-server-warmup makes the server Up at once
    DATAGEN_STANDIN_GPU_ARCH            pretend compute capability, e.g. "12.0": a hybrid model (Qwen3_5*) with
                                        an attention backend outside {triton, trtllm_mha, flashinfer} fails
                                        startup with SGLang's AssertionError (exit 1); fa3 fails on >= 10.0
    DATAGEN_STANDIN_LENGTH_MEAN         mean output length in tokens, lognormal (200)
    DATAGEN_STANDIN_LENGTH_SIGMA        lognormal sigma of the output length (0.6)
    DATAGEN_STANDIN_LENGTH_MAX          longest output before max_new_tokens applies (2000)
    DATAGEN_STANDIN_REASONING_FRACTION  mean share of a thinking output spent before </think> (0.7)
    DATAGEN_STANDIN_MAX_RUNNING         running-request limit when --max-running-requests is absent (64;
                                        48 with --speculative-algorithm EAGLE/NEXTN, as SGLang)
    DATAGEN_STANDIN_MAX_TOTAL_TOKENS    KV capacity reported as max_total_num_tokens (1048576)
    DATAGEN_STANDIN_GPU_MEMORY_BYTES    emulate a GPU of this size (unset: no sizing). For a hybrid GDN model
                                        (Qwen3.5/3.6) the running-request cap and the KV capacity are then what
                                        SGLang 0.5.23's pool sizing gives for the server's flags
                                        (`datagen.engine.memory_plan.sglang_sizing`, judged against the real
                                        code in tests/conformance/test_memory_plan_conformance.py) instead
                                        of MAX_RUNNING / MAX_TOTAL_TOKENS
    DATAGEN_STANDIN_WEIGHTS_BYTES       weights loaded on that GPU (54714000000: Qwen3.6-27B BF16, estimate)
    DATAGEN_STANDIN_ENGINE_RESERVED_BYTES  memory the emulated engine takes before it measures what is free for
                                        the model (0; 1073741824 acts as SGLang 0.5.17's CUDA IPC multimodal
                                        pool, issue 37): the pools shrink, the plan's prediction does not, and
                                        the launcher's pool check relaunches with a recalibrated plan
    DATAGEN_STANDIN_ACTIVATION_BYTES    with GPU_MEMORY_BYTES: the activation peak of a prefill forward pass of a
                                        full chunk (--chunked-prefill-size tokens; fewer tokens, that share; 0: not
                                        modelled). The memory outside the pools is P (1 - mem_fraction_static), P
                                        the free memory before the weights; the CUDA graphs below take their share
                                        at start (too little: the start fails with CUDA's out-of-memory error), and
                                        a prefill batch that needs more than what is left kills the server with
                                        that error, as SGLang's scheduler dies (exit 1). (No name here says
                                        "TOKEN": the launcher keeps such variables from servers as secrets.)
    DATAGEN_STANDIN_PREFILL_GRAPH_BYTES  prefill CUDA graphs at the server's chunk size (0)
    DATAGEN_STANDIN_DECODE_GRAPH_BYTES_PER_BATCH  decode CUDA graphs per request of the largest captured batch (0)
    DATAGEN_STANDIN_STEP_BASE_MS        fixed cost of one single-token decode step, ms (0)
    DATAGEN_STANDIN_STEP_PER_REQ_MS     extra cost per running request per single-token step, ms (0)
    DATAGEN_STANDIN_TIME_SCALE          multiplies all step times (1.0)
    DATAGEN_STANDIN_TOKENS_PER_STEP     tokens each loop iteration advances every running request (16); the
                                        iteration sleeps that many single-token steps, so it changes only
                                        CPU cost, not simulated throughput
    DATAGEN_STANDIN_ERROR_RATE          fraction of generation requests answered 500 InternalServerError (0)
    DATAGEN_STANDIN_STALL_AFTER         after N generation requests, new ones hang and /health turns 503 (unset)
    DATAGEN_STANDIN_CRASH_AFTER         exit abruptly (code 1) right after the N-th successful response (unset)
    DATAGEN_STANDIN_SEED                seed of outputs and of fault injection (0)

A decode step of a batch of B running requests takes
(STEP_BASE_MS + STEP_PER_REQ_MS * B) * TIME_SCALE ms per token; e.g. 20 + 0.5*B gives ~1,230 tok/s at B=64.
`datagen.standin.testing.run_standin` starts one for tests. See README.md in this directory.
"""

__all__ = ["SGLANG_VERSION"]

SGLANG_VERSION = "0.5.23"
