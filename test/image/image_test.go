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
	if !strings.Contains(buildLine, "CGO_ENABLED=0") || !strings.Contains(buildLine, "./cmd/csibroker") {
		t.Fatalf("Dockerfile build line %q: want a CGO_ENABLED=0 build of ./cmd/csibroker", buildLine)
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
	bin := filepath.Join(t.TempDir(), "csibroker")
	cmd := exec.Command("go", "build", "-ldflags", "-s -w -X main.version=image-test", "-o", bin, "./cmd/csibroker")
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Fatal("the binary asks for a dynamic loader: not static, would not run on distroless/static")
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Fatalf("the binary needs shared libraries %v", libs)
	}

	// Every subcommand the manifests run exists in the binary.
	subs := map[string]bool{}
	re := regexp.MustCompile(`(?m)^\s*(?:args|command):\s*\[\s*"?([a-z-]+)"?`)
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
		// -h prints the flags and exits 2 (flag.ErrHelp); an unknown
		// subcommand says so.
		if strings.Contains(string(out), "unknown subcommand") || !strings.Contains(string(out), "-") {
			t.Errorf("subcommand %q: %v\n%s", s, err, out)
		}
	}
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "image-test") {
		t.Fatalf("version: %v %s", err, out)
	}
}
