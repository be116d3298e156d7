package testenv

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/csibroker/csibroker/internal/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		helperProcess(mode) // the child of TestInterruptCleansUp and TestAbruptDeathKillsComponents
	}
	testutil.SkipPackageIfShort("starts real control planes")
	Main(m, Options{})
}

func TestMissingBinariesFailWithHowToFix(t *testing.T) {
	_, err := Start(context.Background(), Options{BinDir: t.TempDir(), Scheduler: true})
	if err == nil {
		t.Fatal("Start with an empty bin dir succeeded")
	}
	for _, want := range []string{"hack/control-plane.sh", "etcd", "kube-apiserver", "kube-scheduler", BinDirEnv} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

func TestStartFailureShowsLogsAndCleansUp(t *testing.T) {
	// The shared control plane may run already (its components stay
	// registered): count only what this start leaves.
	live.Lock()
	before := len(live.components)
	live.Unlock()
	_, err := Start(t.Context(), Options{APIServerFlags: []string{"--no-such-flag"}, Logf: t.Logf})
	if err == nil {
		t.Fatal("Start with a bad apiserver flag succeeded")
	}
	for _, want := range []string{"kube-apiserver exited", "kube-apiserver.log", "unknown flag: --no-such-flag", "etcd.log"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
	// Other test processes may have directories of their own: check this one.
	m := regexp.MustCompile(`\((\S+) removed; set `).FindStringSubmatch(err.Error())
	if m == nil {
		t.Fatalf("error does not say which directory it removed:\n%v", err)
	}
	if _, err := os.Stat(m[1]); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s left behind (%v)", m[1], err)
	}
	live.Lock()
	n := len(live.components) - before
	live.Unlock()
	if n != 0 {
		t.Errorf("%d components still registered after a failed start", n)
	}
}

func TestSharedServesTheAPI(t *testing.T) {
	env := Shared(t)
	ctx := t.Context()
	v, err := env.Client().Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	if v.GitVersion != KubernetesVersion {
		t.Errorf("server version %s, want %s", v.GitVersion, KubernetesVersion)
	}
	// The storage kinds the broker works with are served.
	if _, err := env.Client().StorageV1().CSIDrivers().List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("list CSIDrivers: %v", err)
	}
	if _, err := env.Client().StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("list VolumeAttachments: %v", err)
	}
	kc, err := os.ReadFile(env.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{env.Host, "certificate-authority-data:", "token:"} {
		if !strings.Contains(string(kc), want) {
			t.Errorf("kubeconfig lacks %q", want)
		}
	}
	if strings.Contains(string(kc), "insecure-skip-tls-verify") {
		t.Error("kubeconfig skips TLS verification")
	}
	if !strings.HasPrefix(env.Host, "https://127.0.0.1:") {
		t.Errorf("apiserver at %s, want loopback", env.Host)
	}
}

func TestNamespaceHasDefaultServiceAccount(t *testing.T) {
	env := Shared(t)
	ns := env.NewNamespace(t)
	if !strings.HasPrefix(ns, "testnamespacehasdefaultserviceaccount-") {
		t.Errorf("namespace %q is not named after the test", ns)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p"},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "none"}}},
	}
	if _, err := env.Client().CoreV1().Pods(ns).Create(t.Context(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create a pod (needs the default service account): %v", err)
	}
}

func TestAddNodesAndCSINode(t *testing.T) {
	env := Shared(t)
	ctx := t.Context()
	c := env.Client()
	name := "node-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	nodes, err := env.AddNodes(ctx, NodeSpec{Name: name, Zone: "z1", Region: "r1", Labels: map[string]string{"example.com/rack": "7"}, CPU: "2"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	n := nodes[0]
	if len(n.Spec.Taints) != 0 {
		t.Errorf("taints %v, want none", n.Spec.Taints)
	}
	if got := n.Status.Allocatable.Cpu().String(); got != "2" {
		t.Errorf("allocatable cpu %s, want 2", got)
	}
	if n.Status.Allocatable.Memory().IsZero() || n.Status.Allocatable.Pods().IsZero() {
		t.Errorf("allocatable %v lacks memory or pods", n.Status.Allocatable)
	}
	if !slices.ContainsFunc(n.Status.Conditions, func(c corev1.NodeCondition) bool {
		return c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue
	}) {
		t.Errorf("node is not Ready: %v", n.Status.Conditions)
	}
	for k, v := range map[string]string{LabelZone: "z1", LabelRegion: "r1", "example.com/rack": "7", corev1.LabelHostname: name} {
		if n.Labels[k] != v {
			t.Errorf("label %s=%q, want %q", k, n.Labels[k], v)
		}
	}
	if n.Annotations[AnnotationControllerManagedAttach] != "true" {
		t.Errorf("annotations %v lack %s", n.Annotations, AnnotationControllerManagedAttach)
	}

	if err := env.AddCSINode(ctx, name, "a.example.com", "id-a", []string{LabelZone}); err != nil {
		t.Fatal(err)
	}
	if err := env.AddCSINode(ctx, name, "b.example.com", "id-b", nil); err != nil {
		t.Fatal(err)
	}
	if err := env.AddCSINode(ctx, name, "a.example.com", "id-a2", []string{LabelZone, "example.com/rack"}); err != nil {
		t.Fatal(err)
	}
	if err := env.AddCSINode(ctx, name, "c.example.com", "id-c", []string{"missing"}); err == nil {
		t.Error("AddCSINode accepted a topology key the node has no label for")
	}
	csiNode, err := c.StorageV1().CSINodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, d := range csiNode.Spec.Drivers {
		got[d.Name] = d.NodeID + " " + strings.Join(d.TopologyKeys, ",")
	}
	want := map[string]string{"a.example.com": "id-a2 " + LabelZone + ",example.com/rack", "b.example.com": "id-b "}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("CSINode drivers %v, want %v", got, want)
	}
	if len(csiNode.OwnerReferences) != 1 || csiNode.OwnerReferences[0].UID != n.UID {
		t.Errorf("CSINode owner references %v, want the Node", csiNode.OwnerReferences)
	}
	n, err = c.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := n.Annotations[AnnotationCSINodeIDs], `{"a.example.com":"id-a2","b.example.com":"id-b"}`; got != want {
		t.Errorf("node ID annotation %s, want %s", got, want)
	}
}

// TestNewStopsAtCleanup starts a private control plane with every component
// through New and checks that the test's cleanup ends every process and
// removes the directory.
func TestNewStopsAtCleanup(t *testing.T) {
	var env *Env
	t.Run("run", func(t *testing.T) {
		env = New(t, Options{ControllerManager: true, Scheduler: true})
		pids := env.pids()
		if len(pids) != 4 {
			t.Errorf("started %d processes, want 4", len(pids))
		}
		for _, p := range pids {
			if pgid, err := syscall.Getpgid(p); err != nil || pgid != p {
				t.Errorf("process %d is in group %d (%v), want its own", p, pgid, err)
			}
		}
	})
	if env == nil {
		t.Fatal("no control plane")
	}
	for _, p := range env.pids() {
		if alive(p) {
			t.Errorf("process %d still alive after the test's cleanup", p)
		}
	}
	if _, err := os.Stat(env.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s still there after the test's cleanup (%v)", env.Dir, err)
	}
	env.Stop() // idempotent
}

func (e *Env) pids() []int {
	var pids []int
	for _, c := range e.components {
		pids = append(pids, c.cmd.Process.Pid)
	}
	return pids
}

// alive reports whether pid exists and is not a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

// The helper process for the two tests below: it starts a control plane,
// reports it, then waits to be signalled or kills itself.
const helperEnv = "TESTENV_CHILD"

func helperProcess(mode string) {
	env, err := Start(context.Background(), Options{Logf: func(string, ...any) {}})
	if err != nil {
		fmt.Println("ERROR", err)
		os.Exit(3)
	}
	fmt.Println("READY", env.Dir, strings.Trim(fmt.Sprint(env.pids()), "[]"))
	if mode == "die" {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	}
	time.Sleep(time.Minute)
	os.Exit(4)
}

type child struct {
	cmd  *exec.Cmd
	dir  string
	pids []int
}

func startChild(t *testing.T, mode string, env ...string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(append(os.Environ(), helperEnv+"="+mode), env...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "READY":
			c := &child{cmd: cmd, dir: f[1]}
			for _, p := range f[2:] {
				pid, err := strconv.Atoi(p)
				if err != nil {
					t.Fatalf("helper: bad pid in %q", sc.Text())
				}
				c.pids = append(c.pids, pid)
			}
			if len(c.pids) == 0 {
				// The clean-up checks would pass on nothing.
				t.Fatalf("helper named no process: %q", sc.Text())
			}
			go func() { _, _ = bufio.NewReader(out).WriteTo(nopWriter{}) }()
			return c
		case "ERROR":
			t.Fatalf("helper: %s", sc.Text())
		}
	}
	t.Fatalf("helper exited without starting a control plane: %v", cmd.Wait())
	return nil
}

type nopWriter struct{}

func (nopWriter) Write(p []byte) (int, error) { return len(p), nil }

func waitGone(t *testing.T, pids []int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for _, p := range pids {
		for alive(p) {
			if time.Now().After(deadline) {
				t.Errorf("process %d still alive", p)
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

func TestInterruptCleansUp(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			c := startChild(t, "wait")
			if err := c.cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			err := c.cmd.Wait()
			var ee *exec.ExitError
			if !errors.As(err, &ee) {
				t.Fatalf("helper ended with %v, want death by %v", err, sig)
			}
			if ws := ee.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != sig {
				t.Errorf("helper ended with %v, want death by %v (re-raised)", err, sig)
			}
			waitGone(t, c.pids)
			if _, err := os.Stat(c.dir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s left behind (%v)", c.dir, err)
			}
		})
	}
}

func TestAbruptDeathKillsComponents(t *testing.T) {
	// The helper's directory goes in a temporary directory of this test's
	// own: the sweeps of other test processes running now (they scan the
	// system's) must not remove it before this test looks.
	tmp, err := os.MkdirTemp("", "tenv")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	c := startChild(t, "die", "TMPDIR="+tmp)
	if !strings.HasPrefix(c.dir, tmp+string(filepath.Separator)) {
		t.Fatalf("the helper's directory %s is not in %s", c.dir, tmp)
	}
	t.Setenv("TMPDIR", tmp) // sweepStaleDirs below scans it
	_ = c.cmd.Wait()
	waitGone(t, c.pids) // Pdeathsig
	if _, err := os.Stat(filepath.Join(c.dir, ownerPIDFile)); err != nil {
		t.Fatalf("expected the dead helper's directory to remain until swept: %v", err)
	}
	sweepStaleDirs()
	if _, err := os.Stat(c.dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s not swept (%v)", c.dir, err)
	}
}

// TestDefaultBinDirRelativeCache: a relative CSIBROKER_CACHE is taken from
// the repository's root, as hack/control-plane.sh (run there by make)
// takes it, whatever package the test runs in.
func TestDefaultBinDirRelativeCache(t *testing.T) {
	t.Setenv("CSIBROKER_CACHE", ".cache/cb")
	got := DefaultBinDir()
	root := moduleRoot()
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("module root %s holds no go.mod", root)
	}
	if want := filepath.Join(root, ".cache/cb", "control-plane"); !strings.HasPrefix(got, want) {
		t.Fatalf("DefaultBinDir() = %s, want under %s", got, want)
	}
}
