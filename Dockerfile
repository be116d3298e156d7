# syntax=docker/dockerfile:1
# One static binary serves every subcommand: broker, proxy, sample-driver,
# certs, status (and demo, which also needs the control-plane binaries of
# hack/control-plane.sh, not in this image). Next to it, /csibroker-proxy is the proxy built alone
# (same flags, none of the broker's code): the process that runs beside every
# driver socket. Build: docker build -t csibroker . (csibroker:latest, the
# tag deploy/ names), or make docker (csibroker:<git describe>, see
# docs/install.md for pointing deploy/ at it).
#
# The Go release go.mod requires (its go line; test/deploy checks they
# agree), not whatever 1.26.x a floating tag holds that day. GOTOOLCHAIN=local:
# should they ever disagree, the build fails instead of downloading another
# toolchain.
FROM golang:1.26.8 AS build
ENV GOTOOLCHAIN=local
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
