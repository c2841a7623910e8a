"""Span, attribute and metric names: the one place they are spelled (documented in docs/spans.md).

OpenTelemetry GenAI conventions and vLLM's span attributes where they exist; a `stepscope.`
prefix where none does. Units are in the names (`_s` seconds, `_ns` nanoseconds, `_bytes`).
The collector's materialized views read these same strings.
"""

# --- span names -------------------------------------------------------------------------------
SPAN_REQUEST = "llm_request"  # root per request, kind SERVER (vLLM's name)
SPAN_QUEUE = "queue"
SPAN_PREFILL = "prefill"  # one per prefill chunk
SPAN_KV_TRANSFER = "kv_transfer"
SPAN_DECODE = "decode"
SPAN_STEP = "engine.step"
SPAN_STEP_SCHEDULE = "engine.step.schedule"
SPAN_STEP_FORWARD = "engine.step.forward"
SPAN_STEP_SAMPLE = "engine.step.sample"
SPAN_CLIENT_REQUEST = "llm_client_request"  # the load generator's CLIENT span
SPAN_ROUTE = "route"  # the fleet router's choice of a replica, parent of the replica's llm_request
EVENT_FIRST_TOKEN = "first_token"

# --- llm_request attributes (vLLM-compatible, seconds as doubles) ------------------------------
GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_LATENCY_TTFT = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
GEN_AI_LATENCY_QUEUE = "gen_ai.latency.time_in_queue"
GEN_AI_LATENCY_PREFILL = "gen_ai.latency.time_in_model_prefill"
GEN_AI_LATENCY_DECODE = "gen_ai.latency.time_in_model_decode"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"  # vLLM's older name
GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"  # vLLM's older name
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"

# stepscope extras on llm_request
PREFIX_KEY = "stepscope.prefix_cache.key"  # hex hash of the first full prompt block ("" when none)
PREEMPTIONS = "stepscope.preemptions"
TPOT_MEAN_S = "stepscope.tpot.mean_s"
TPOT_MAX_S = "stepscope.tpot.max_s"
ITL_COUNT = "stepscope.itl.count"
KV_TRANSFER_S = "stepscope.latency.kv_transfer_s"
RPC_DELAY_MEAN_S = "stepscope.rpc.delay_mean_s"  # core produced a token -> front end received it (mean)
RPC_DELAY_MAX_S = "stepscope.rpc.delay_max_s"  # the same, the longest of the request
FRONTEND_S = "stepscope.latency.frontend_s"  # HTTP receipt -> handed to the core's queue (parse, tokenize)
FRONTEND_LOOP_LAG_S = "stepscope.frontend.loop_lag_s"  # the front end's event-loop lag, worst while it ran
SAMPLING_WEIGHT = "stepscope.sampling.weight"  # requests this kept span stands for (1 / head ratio, or 1)

# --- route span attributes (engine/fleet) -------------------------------------------------------
ROUTE_POLICY = "stepscope.route.policy"  # round_robin | least_loaded | prefix_aware
ROUTE_INSTANCE = "stepscope.route.instance"  # the chosen replica's service.instance.id
ROUTE_CANDIDATES = "stepscope.route.candidates"  # the healthy replicas' instance ids ...
ROUTE_CANDIDATE_LOADS = "stepscope.route.candidate_loads"  # ... their requests in flight ...
ROUTE_CANDIDATE_PREFIX_BLOCKS = "stepscope.route.candidate_prefix_blocks"  # ... their leading-block match
ROUTE_PREFIX_BLOCKS = "stepscope.route.prefix_blocks"  # full blocks in the prompt
ROUTE_ATTEMPTS = "stepscope.route.attempts"  # 1, or more when a replica failed before answering

# --- phase span attributes ---------------------------------------------------------------------
CHUNK_INDEX = "stepscope.prefill.chunk_index"
CHUNK_TOKENS = "stepscope.prefill.chunk_tokens"
KV_TRANSFER_BYTES = "stepscope.kv_transfer.bytes"
KV_TRANSFER_BLOCKS = "stepscope.kv_transfer.blocks"
KV_TRANSFER_BANDWIDTH = "stepscope.kv_transfer.bandwidth_bytes_per_s"
KV_TRANSFER_SIDE = "stepscope.kv_transfer.side"  # send (prefill worker) | receive (decode worker)
KV_TRANSFER_PEER = "stepscope.kv_transfer.peer"  # send side: the decode worker's KV address

# --- engine.step attributes --------------------------------------------------------------------
STEP_ID = "stepscope.step.id"
STEP_NUM_RUNNING = "stepscope.step.num_running"
STEP_NUM_WAITING = "stepscope.step.num_waiting"
STEP_BATCH_SIZE = "stepscope.step.batch_size"
STEP_PREFILL_TOKENS = "stepscope.step.prefill_tokens"
STEP_DECODE_TOKENS = "stepscope.step.decode_tokens"
STEP_KV_BLOCKS_USED = "stepscope.step.kv_blocks_used"
STEP_KV_BLOCKS_FREE = "stepscope.step.kv_blocks_free"
STEP_KV_BLOCKS_TOTAL = "stepscope.step.kv_blocks_total"
STEP_PREEMPTIONS = "stepscope.step.preemptions"
STEP_PREFIX_HIT_TOKENS = "stepscope.step.prefix_cache_hit_tokens"
STEP_WEIGHT_DTYPE = "stepscope.step.weight_dtype"
STEP_KV_DTYPE = "stepscope.step.kv_dtype"
STEP_CHUNKED_PREFILL = "stepscope.step.chunked_prefill"
STEP_MAX_NUM_SEQS = "stepscope.step.max_num_seqs"
STEP_GAP_S = "stepscope.step.gap_s"  # idle time between the previous step's end and this step's start
STEP_BYTES_READ = "stepscope.step.bytes_read"
STEP_CPU_S = "stepscope.step.cpu_s"  # CPU time of the stepping thread over the step (thread_time_ns)
LINK_TOKENS = "stepscope.link.tokens"  # on each engine.step -> llm_request link

# --- resource attributes -----------------------------------------------------------------------
RESOURCE_MODEL = "stepscope.model"
RESOURCE_INSTANCE = "service.instance.id"
RESOURCE_ROLE = "stepscope.role"  # colocated | prefill | decode | router
RESOURCE_HOST = "host.name"

# --- added with the instrumentation issue ------------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # chat | text_completion
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"  # input | output (| cached, stepscope's own)
ERROR_TYPE = "error.type"
SAMPLING_REASON = "stepscope.sampling.reason"  # why a request span was kept: head | slow | error

# phase spans
PREFILL_COMPUTED_BEFORE = "stepscope.prefill.computed_before"  # tokens already in the KV cache
PREFILL_RECOMPUTE = "stepscope.prefill.recompute"  # re-computing a preempted request's tokens
QUEUE_AFTER_PREEMPTION = "stepscope.queue.after_preemption"
DECODE_TOKENS = "stepscope.decode.tokens"  # output tokens after the first

# engine.step extras
STEP_MAX_NUM_BATCHED_TOKENS = "stepscope.step.max_num_batched_tokens"
STEP_SAMPLED_EVERY = "stepscope.step.sampled_every"  # 1-in-N step sampling: the N in force
LINK_IS_PREFILL = "stepscope.link.is_prefill"

# GPU / host counters on engine.step (the steps view keeps every stepscope.gpu.* / stepscope.host.*).
# Per GPU: f"{GPU_PREFIX}{index}.{name}" with these names; ratios are 0..1.
GPU_PREFIX = "stepscope.gpu."
GPU_SM_UTILIZATION = "sm_utilization"  # ratio
GPU_MEM_BW_UTILIZATION = "mem_bandwidth_utilization"  # ratio
GPU_MEMORY_USED_BYTES = "memory_used_bytes"
GPU_MEMORY_TOTAL_BYTES = "memory_total_bytes"
GPU_POWER_W = "power_w"
GPU_SM_CLOCK_MHZ = "sm_clock_mhz"
GPU_TEMPERATURE_C = "temperature_c"
HOST_CPU_UTILIZATION = "stepscope.host.cpu_utilization"  # ratio, all cores
HOST_CPU_STEAL = "stepscope.host.cpu_steal"  # ratio of all cores' time stolen by the hypervisor
HOST_LOAD_1M = "stepscope.host.load_1m"  # 1-minute load average (runnable + uninterruptible tasks)
HOST_PROCS_RUNNING = "stepscope.host.procs_running"  # runnable tasks now (/proc/stat)
HOST_CPUS = "stepscope.host.cpus"  # cores this process may run on
HOST_ENGINE_CPU_SHARE = "stepscope.host.engine_cpu_share"  # cores' worth of CPU the engine core process used
GPU_CLOCKS_EVENT_REASONS = "clocks_event_reasons"  # NVML bitmask: why clocks are held down (0: none)
GPU_SM_CLOCK_MAX_MHZ = "sm_clock_max_mhz"
GPU_PROCESSES = "processes"  # compute processes on the GPU (others than the engine: contention)
GPU_INDEX = "stepscope.gpu.index"  # attribute of the GPU gauges

# --- metrics (name, unit) ----------------------------------------------------------------------
METRIC_TTFT = "gen_ai.server.time_to_first_token"  # s, histogram
METRIC_TPOT = "gen_ai.server.time_per_output_token"  # s, histogram
METRIC_REQUEST_DURATION = "gen_ai.server.request.duration"  # s, histogram
METRIC_QUEUE_TIME = "stepscope.server.time_in_queue"  # s, histogram
METRIC_TOKENS = "stepscope.server.tokens"  # {token}, counter by gen_ai.token.type
METRIC_RUNNING = "stepscope.engine.requests.running"  # {request}, gauge
METRIC_WAITING = "stepscope.engine.requests.waiting"  # {request}, gauge
METRIC_KV_USAGE = "stepscope.engine.kv_cache.usage"  # 1 (ratio), gauge
METRIC_PREFIX_HIT_RATIO = "stepscope.engine.prefix_cache.hit_ratio"  # 1 (ratio), gauge
METRIC_PREEMPTIONS = "stepscope.engine.preemptions"  # {preemption}, counter
METRIC_DROPPED = "stepscope.telemetry.dropped"  # {item}, counter by kind and process
DROPPED_KIND = "stepscope.telemetry.kind"  # spans | events
DROPPED_PROCESS = "stepscope.telemetry.process"  # frontend | core
METRIC_GPU_PREFIX = "stepscope.gpu."  # gauges stepscope.gpu.<name>, attribute stepscope.gpu.index

# GenAI semantic-convention bucket boundaries (ExplicitBucketBoundaries advisory of each metric)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS_S = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
