package policy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
	"unicode"

	"github.com/hashicorp/go-retryablehttp"
)

// External decision point defaults.
const (
	DefaultExternalAttemptTimeout = 250 * time.Millisecond
	DefaultExternalTimeout        = time.Second
	DefaultExternalMaxAttempts    = 3
	DefaultExternalRetryWaitMin   = 10 * time.Millisecond
	DefaultExternalRetryWaitMax   = 100 * time.Millisecond
	DefaultExternalCacheTTL       = 2 * time.Second
	DefaultExternalCacheSize      = 10_000

	// maxExternalBody bounds what is read of an answer.
	maxExternalBody = 64 << 10
	// maxExternalReason bounds the reason kept from an answer.
	maxExternalReason = 200
)

// ExternalConfig configures an external decision point that speaks OPA's
// data API: POST <URL>/v1/data/<Path> with {"input": <Request>}, answered by
// {"result": true|false} or {"result": {"allow": bool, "reason": string}}.
// Zero durations and sizes take the defaults above.
type ExternalConfig struct {
	// URL is the server's base URL, e.g. "http://127.0.0.1:8181". It must
	// not carry user info, a query or a fragment (put credentials in Header).
	URL string
	// Path is the data document, e.g. "csibroker/allow".
	Path string
	// Header is added to every request (e.g. "Authorization").
	Header http.Header
	// AttemptTimeout bounds one HTTP attempt.
	AttemptTimeout time.Duration
	// Timeout bounds a whole decision, retries and their waits included.
	Timeout time.Duration
	// MaxAttempts bounds attempts per decision (1: no retry). Connection
	// errors, attempt timeouts, 5xx (but 501) and 429 are retried.
	MaxAttempts int
	// RetryWaitMin and RetryWaitMax bound the backoff between attempts.
	RetryWaitMin, RetryWaitMax time.Duration
	// CacheTTL is how long an answer (allow or deny) is reused for an
	// identical request; negative disables the cache. Failures are never
	// cached.
	CacheTTL time.Duration
	// CacheSize bounds the number of cached answers.
	CacheSize int
	// HTTPClient, if set, provides the transport (e.g. TLS settings). It is
	// copied; its Timeout and redirect policy are replaced.
	HTTPClient *http.Client
	// Logger receives the HTTP client's retry messages; nil: none.
	Logger *slog.Logger
}

func (c ExternalConfig) withDefaults() ExternalConfig {
	if c.AttemptTimeout == 0 {
		c.AttemptTimeout = DefaultExternalAttemptTimeout
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultExternalTimeout
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultExternalMaxAttempts
	}
	if c.RetryWaitMin == 0 {
		c.RetryWaitMin = DefaultExternalRetryWaitMin
	}
	if c.RetryWaitMax == 0 {
		c.RetryWaitMax = DefaultExternalRetryWaitMax
	}
	if c.CacheTTL == 0 {
		c.CacheTTL = DefaultExternalCacheTTL
	}
	if c.CacheSize == 0 {
		c.CacheSize = DefaultExternalCacheSize
	}
	return c
}

// Validate reports a configuration that cannot work.
func (c ExternalConfig) Validate() error {
	u, err := url.Parse(c.URL)
	if err != nil {
		// The url.Error quotes the whole URL, credentials included: drop it.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return fmt.Errorf("external decision point URL cannot be parsed: %w", err)
	}
	switch {
	case u.User != nil:
		return errors.New("external decision point URL: must not carry user info (use Header)")
	// Not echoed either: without a scheme and host, user info may be read
	// as a path ("http//user:password@host") or an opaque part.
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("external decision point URL: scheme %q, want http or https (http://host[:port])", u.Scheme)
	case u.Host == "":
		return errors.New("external decision point URL: no host (want http://host[:port] or https://host[:port])")
	case u.RawQuery != "" || u.Fragment != "":
		// Not echoed: a query may carry a token.
		return fmt.Errorf("external decision point URL %s://%s%s: must not carry a query or fragment", u.Scheme, u.Host, u.EscapedPath())
	}
	p := strings.Trim(c.Path, "/")
	if p == "" {
		return errors.New("external decision point path: empty (e.g. csibroker/allow)")
	}
	for _, seg := range strings.Split(p, "/") {
		if seg == "" || seg == "." || seg == ".." || strings.ContainsAny(seg, "?#% \t\r\n") {
			return fmt.Errorf("external decision point path %q: bad segment %q", c.Path, seg)
		}
	}
	switch {
	case c.AttemptTimeout < 0, c.Timeout < 0, c.RetryWaitMin < 0, c.RetryWaitMax < 0:
		return errors.New("external decision point: negative timeout or wait")
	case c.MaxAttempts < 0:
		return errors.New("external decision point: negative MaxAttempts")
	case c.CacheSize < 0:
		return errors.New("external decision point: negative CacheSize")
	}
	return nil
}

// External asks an OPA-compatible decision point. It fails closed: when the
// endpoint is slow, unreachable, or answers anything but HTTP 200 with a
// boolean decision, the answer is deny, with a reason saying why. The input
// holds only references (the Request); this package never sees secret
// content. Safe for concurrent use.
type External struct {
	url     string
	timeout time.Duration
	header  http.Header
	client  *retryablehttp.Client
	cache   *decisionCache
}

// NewExternal builds an External from cfg (defaults applied, then validated).
func NewExternal(cfg ExternalConfig) (*External, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	hc := &http.Client{}
	if cfg.HTTPClient != nil {
		cp := *cfg.HTTPClient
		hc = &cp
	}
	if hc.Transport == nil {
		hc.Transport = http.DefaultTransport.(*http.Transport).Clone()
	}
	hc.Timeout = cfg.AttemptTimeout
	// The input goes to the configured server and nowhere else.
	hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

	rc := retryablehttp.NewClient()
	rc.HTTPClient = hc
	rc.Logger = nil
	if cfg.Logger != nil {
		rc.Logger = cfg.Logger
	}
	rc.RetryMax = cfg.MaxAttempts - 1
	rc.RetryWaitMin = cfg.RetryWaitMin
	rc.RetryWaitMax = cfg.RetryWaitMax
	rc.CheckRetry = retryablehttp.DefaultRetryPolicy
	rc.ErrorHandler = func(resp *http.Response, err error, attempts int) (*http.Response, error) {
		if resp != nil && err == nil {
			return resp, nil // retries used up on a 5xx/429: report its status
		}
		if resp != nil {
			resp.Body.Close()
		}
		if err == nil {
			err = errors.New("no response")
		}
		return nil, fmt.Errorf("after %d attempt(s): %w", attempts, err)
	}

	e := &External{
		url:     strings.TrimRight(cfg.URL, "/") + "/v1/data/" + strings.Trim(cfg.Path, "/"),
		timeout: cfg.Timeout,
		header:  cfg.Header.Clone(),
		client:  rc,
	}
	if cfg.CacheTTL > 0 {
		e.cache = newDecisionCache(cfg.CacheTTL, cfg.CacheSize)
	}
	return e, nil
}

// URL is the data API URL queried.
func (e *External) URL() string { return e.url }

// Decide asks the external decision point alone, in enforce mode. A
// malformed request is denied without asking.
func (e *External) Decide(ctx context.Context, req Request) Decision {
	if err := req.validate(); err != nil {
		return decisionFor(ModeEnforce, &req, verdict{rule: RuleInvalidRequest, reason: "invalid request, denied: " + err.Error()})
	}
	return decisionFor(ModeEnforce, &req, e.verdict(ctx, &req))
}

// verdict asks about a validated request.
func (e *External) verdict(ctx context.Context, req *Request) verdict {
	allowed, reason, err := e.query(ctx, req)
	switch {
	case err != nil:
		return verdict{rule: RuleExternal, reason: "external decision point " + e.url +
			" could not decide on " + describe(req) + ", denied (fail closed): " + err.Error()}
	case !allowed:
		v := verdict{rule: RuleExternal, reason: "external decision point " + e.url + " denies " + describe(req)}
		if reason != "" {
			v.reason += ": " + reason
		}
		return v
	default:
		v := verdict{allowed: true, rule: RuleExternal, reason: "external decision point " + e.url + " allows " + describe(req)}
		if reason != "" {
			v.reason += ": " + reason
		}
		return v
	}
}

type externalInput struct {
	Input *Request `json:"input"`
}

// query returns the decision point's answer, from the cache when fresh.
func (e *External) query(ctx context.Context, req *Request) (allowed bool, reason string, err error) {
	body, err := json.Marshal(externalInput{Input: req})
	if err != nil {
		return false, "", fmt.Errorf("encode input: %w", err)
	}
	key := string(body)
	if e.cache != nil {
		if a, ok := e.cache.get(key); ok {
			return a.allowed, a.reason, nil
		}
	}

	ctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	hreq, err := retryablehttp.NewRequestWithContext(ctx, http.MethodPost, e.url, body)
	if err != nil {
		return false, "", fmt.Errorf("build request: %w", err)
	}
	for k, vs := range e.header {
		for _, v := range vs {
			hreq.Header.Add(k, v)
		}
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set("Accept", "application/json")

	resp, err := e.client.Do(hreq)
	if err != nil {
		return false, "", e.classify(ctx, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxExternalBody+1))
	if err != nil {
		return false, "", fmt.Errorf("reading the answer: %w", e.classify(ctx, err))
	}
	if resp.StatusCode != http.StatusOK {
		return false, "", fmt.Errorf("answered HTTP %d, not 200: %s", resp.StatusCode, sanitize(string(data), 100))
	}
	if len(data) > maxExternalBody {
		return false, "", fmt.Errorf("answer larger than %d bytes", maxExternalBody)
	}
	allowed, reason, err = parseExternalAnswer(data)
	if err != nil {
		return false, "", err
	}
	if e.cache != nil {
		e.cache.put(key, answer{allowed: allowed, reason: reason})
	}
	return allowed, reason, nil
}

// classify turns a transport error into a reason.
func (e *External) classify(ctx context.Context, err error) error {
	var ne net.Error
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return fmt.Errorf("no answer within %s: %w", e.timeout, err)
	case errors.Is(ctx.Err(), context.Canceled):
		return fmt.Errorf("decision cancelled: %w", err)
	case errors.As(err, &ne) && ne.Timeout():
		return fmt.Errorf("timed out: %w", err)
	default:
		return fmt.Errorf("unreachable: %w", err)
	}
}

// parseExternalAnswer reads {"result": bool} or {"result": {"allow": bool,
// "reason": string}}. Anything else is an error: an undefined document
// ({}), null, a string, an object without a boolean "allow".
func parseExternalAnswer(data []byte) (bool, string, error) {
	var doc struct {
		Result json.RawMessage `json:"result"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		return false, "", fmt.Errorf("answer is not a JSON object: %s", sanitize(err.Error(), 100))
	}
	res := bytes.TrimSpace(doc.Result)
	if len(res) == 0 || bytes.Equal(res, []byte("null")) {
		return false, "", errors.New(`answer has no "result" (the policy document is undefined)`)
	}
	switch res[0] {
	case 't', 'f':
		var b bool
		if err := json.Unmarshal(res, &b); err != nil {
			return false, "", fmt.Errorf("result is not a boolean: %s", sanitize(err.Error(), 100))
		}
		return b, "", nil
	case '{':
		var obj struct {
			Allow  *bool  `json:"allow"`
			Reason string `json:"reason"`
		}
		if err := json.Unmarshal(res, &obj); err != nil {
			return false, "", fmt.Errorf(`result is not {"allow": bool, "reason": string}: %s`, sanitize(err.Error(), 100))
		}
		if obj.Allow == nil {
			return false, "", errors.New(`result has no boolean "allow"`)
		}
		return *obj.Allow, sanitize(obj.Reason, maxExternalReason), nil
	}
	return false, "", errors.New(`result is neither a boolean nor {"allow": bool, "reason": string}`)
}

// sanitize bounds s and replaces control and non-printable characters, so
// an answer cannot forge log lines or Event text.
func sanitize(s string, n int) string {
	s = strings.Map(func(r rune) rune {
		if !unicode.IsPrint(r) {
			return '?'
		}
		return r
	}, strings.TrimSpace(s))
	return truncate(s, n)
}

// answer is a cached decision.
type answer struct {
	allowed bool
	reason  string
	expires time.Time
}

// decisionCache is a small TTL cache; when full it drops expired entries,
// then arbitrary ones.
type decisionCache struct {
	ttl  time.Duration
	size int
	now  func() time.Time

	mu sync.Mutex
	m  map[string]answer
}

func newDecisionCache(ttl time.Duration, size int) *decisionCache {
	return &decisionCache{ttl: ttl, size: size, now: time.Now, m: make(map[string]answer)}
}

func (c *decisionCache) get(key string) (answer, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	a, ok := c.m[key]
	if !ok {
		return answer{}, false
	}
	if !c.now().Before(a.expires) {
		delete(c.m, key)
		return answer{}, false
	}
	return a, true
}

func (c *decisionCache) put(key string, a answer) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	a.expires = now.Add(c.ttl)
	if _, ok := c.m[key]; !ok && len(c.m) >= c.size {
		for k, v := range c.m {
			if !now.Before(v.expires) {
				delete(c.m, k)
			}
		}
		for k := range c.m {
			if len(c.m) < c.size {
				break
			}
			delete(c.m, k)
		}
	}
	c.m[key] = a
}

func (c *decisionCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}
