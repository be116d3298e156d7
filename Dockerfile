# syntax=docker/dockerfile:1
# One static binary serves every subcommand: broker, proxy, sample-driver,
# certs, status (and demo, which also needs the control-plane binaries of
# hack/control-plane.sh, not in this image). Next to it, /csibroker-proxy is the proxy built alone
# (same flags, none of the broker's code): the process that runs beside every
# driver socket. Build: docker build -t csibroker .
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 GOOS=linux go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/ ./cmd/csibroker ./cmd/csibroker-proxy

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/csibroker /out/csibroker-proxy /
USER nonroot:nonroot
ENTRYPOINT ["/csibroker"]
CMD ["broker", "--help"]
