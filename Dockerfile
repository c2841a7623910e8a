# The stepscope image: one image for every service of docker-compose.yml (docs/operations.md).
#
#   docker build -t stepscope .                                   # CPU build of torch (the default)
#   docker build -t stepscope:cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .      # CUDA 12.8 build
#
# The CUDA wheels of torch carry their own CUDA runtime, so the slim Python base serves both; the host
# needs the NVIDIA driver and the NVIDIA Container Toolkit (`docker run --gpus all`, or the compose
# override in docs/operations.md). `stepscope serve --device auto` picks CUDA when it sees a GPU.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler for the native decode-attention kernel (engine/kernels), built on first use for the CPU
# it runs on; without one the engine falls back to the torch path.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen index, so the project's `torch>=...` never pulls another build.
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/stepscope
COPY pyproject.toml README.md ./
COPY stepscope ./stepscope
COPY engine ./engine
COPY instrumentation ./instrumentation
COPY collector ./collector
COPY loadgen ./loadgen
COPY diagnosis ./diagnosis
COPY alerting ./alerting
COPY dashboard ./dashboard
COPY scenarios ./scenarios
RUN pip install . \
    && useradd --create-home --uid 10001 stepscope \
    && mkdir -p /var/lib/stepscope /runs \
    && chown stepscope:stepscope /var/lib/stepscope /runs

USER stepscope
WORKDIR /home/stepscope
# engine, collector (OTLP/HTTP and the query API), dashboard
EXPOSE 8000 4318 8501
CMD ["stepscope", "--help"]
