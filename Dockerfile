# bitnet serve in a container: the OpenAI-compatible server on port 8000, CPU kernels built for the host's CPU.
#   docker build -t bitnet-lm .
#   docker run -p 8000:8000 -e BITNET_API_KEY=change-me bitnet-lm                      # the bundled model
#   docker run -p 8000:8000 -v /models:/models bitnet-lm bitnet serve -m /models/M    # a model of yours
#   docker build --build-arg EXTRAS=serve,ray -t bitnet-lm .                          # with Ray Serve (replicas)
FROM python:3.12-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/bitnet-lm
COPY pyproject.toml setup.py README.md ./
COPY csrc csrc
COPY bitnetlm bitnetlm
RUN pip install --no-cache-dir torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu
ARG EXTRAS=serve
RUN pip install --no-cache-dir ".[$EXTRAS]"
# inside a container the server must listen on every interface to be reachable through -p; set an API key
ENV BITNET_HOST=0.0.0.0 BITNET_PORT=8000
EXPOSE 8000
CMD ["bitnet", "serve"]
