// Package image checks what the Dockerfile promises without a Docker engine
// (none runs here): the build line it uses makes a static binary, its
// entrypoint serves the subcommands the manifests in deploy/ run, and the
// final stage is distroless and non-root.
package image

import (
	"bufio"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

func TestDockerfileBuildsAStaticBinaryServingTheManifestsSubcommands(t *testing.T) {
	df, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	var buildLine, entrypoint, lastFrom, user string
	sc := bufio.NewScanner(strings.NewReader(string(df)))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(line, "RUN ") && strings.Contains(line, "go build"):
			buildLine = strings.TrimPrefix(line, "RUN ")
		case strings.HasPrefix(line, "ENTRYPOINT "):
			entrypoint = line
		case strings.HasPrefix(line, "FROM "):
			lastFrom = line
		case strings.HasPrefix(line, "USER "):
			user = line
		}
	}
	if !strings.Contains(buildLine, "CGO_ENABLED=0") || !strings.Contains(buildLine, "./cmd/csibroker ") || !strings.Contains(buildLine, "./cmd/csibroker-proxy") {
		t.Fatalf("Dockerfile build line %q: want a CGO_ENABLED=0 build of ./cmd/csibroker and ./cmd/csibroker-proxy", buildLine)
	}
	if !strings.Contains(lastFrom, "distroless/static") || !strings.Contains(lastFrom, "nonroot") || !strings.Contains(user, "nonroot") {
		t.Fatalf("final stage %q %q: want distroless static, nonroot", lastFrom, user)
	}
	if !strings.Contains(entrypoint, `"/csibroker"`) {
		t.Fatalf("entrypoint %q", entrypoint)
	}

	// Build as the Dockerfile does (same environment; -trimpath left out,
	// as it only rewrites file paths and would rebuild every dependency
	// outside the test cache).
	dir := t.TempDir()
	bin, proxyBin := filepath.Join(dir, "csibroker"), filepath.Join(dir, "csibroker-proxy")
	cmd := exec.Command("go", "build", "-ldflags", "-s -w -X main.version=image-test", "-o", dir+"/", "./cmd/csibroker", "./cmd/csibroker-proxy")
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	for _, b := range []string{bin, proxyBin} {
		f, err := elf.Open(b)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				t.Fatalf("%s asks for a dynamic loader: not static, would not run on distroless/static", b)
			}
		}
		if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
			t.Fatalf("%s needs shared libraries %v", b, libs)
		}
		f.Close()
	}
	// The proxy binary is the proxy alone: same flags, a fraction of the size.
	out, err := exec.Command(proxyBin, "-h").CombinedOutput()
	for _, flag := range []string{"-driver-endpoint", "-listen", "-tls-cert", "-trust-domain", "-http-endpoint", "-node"} {
		if !strings.Contains(string(out), flag) {
			t.Errorf("csibroker-proxy -h: no %s flag (%v)\n%s", flag, err, out)
		}
	}
	if out, err := exec.Command(proxyBin, "--version").CombinedOutput(); err != nil || !strings.Contains(string(out), "image-test") {
		t.Errorf("csibroker-proxy --version: %v %s", err, out)
	}
	if full, slim := fileSize(t, bin), fileSize(t, proxyBin); slim*2 > full {
		t.Errorf("csibroker-proxy is %d bytes, csibroker %d: the proxy binary links more than the proxy", slim, full)
	}

	// Every subcommand the manifests run exists in the binary.
	subs := map[string]bool{}
	re := regexp.MustCompile(`(?m)^\s*(?:args|command):\s*\[\s*"?/?([a-z-]+)"?`)
	re2 := regexp.MustCompile(`(?m)^\s*(?:args|command):\s*\n\s*-\s*"?([a-z-]+)"?`)
	err = filepath.Walk("../../deploy", func(path string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() || !strings.HasSuffix(path, ".yaml") {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if !strings.Contains(string(b), "image: csibroker") && !strings.Contains(string(b), "csibroker:") {
			return nil
		}
		for _, m := range append(re.FindAllStringSubmatch(string(b), -1), re2.FindAllStringSubmatch(string(b), -1)...) {
			if m[1] == "broker" || m[1] == "proxy" || m[1] == "sample-driver" || m[1] == "status" {
				subs[m[1]] = true
			}
			if m[1] == "csibroker-proxy" {
				subs["proxy"] = true // the proxy binary; the subcommand has the same flags
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !subs["broker"] || !subs["proxy"] {
		t.Fatalf("found subcommands %v in deploy/: expected the broker Deployment and a proxy", subs)
	}
	for s := range subs {
		out, err := exec.Command(bin, s, "-h").CombinedOutput()
		// -h prints the flags and exits 0; an unknown subcommand says so
		// (and exits 2).
		if err != nil || strings.Contains(string(out), "unknown subcommand") || !strings.Contains(string(out), "-") {
			t.Errorf("subcommand %q: %v\n%s", s, err, out)
		}
	}
	out, err = exec.Command(bin, "version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "image-test") {
		t.Fatalf("version: %v %s", err, out)
	}
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}
