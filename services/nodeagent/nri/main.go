// Command kai-isolator-nri is the node agent's NRI plugin: a thin adapter between containerd's Node Resource
// Interface and the agent, which makes every decision.
//
// For a container of a GPU-sharing pod (one carrying KAI's gpu-fraction or gpu-memory annotation) it asks the
// agent, over the agent's unix socket and a one-line JSON protocol, at two points of the container's life:
//   - CreateContainer: the agent holds the answer until the container's grant exists (within a bound shorter than
//     containerd's plugin request timeout) and answers the environment to strip and set, or a refusal;
//   - StartContainer: runc has made the container's cgroups and parked its init at the exec fifo, so the leaf
//     exists and no tenant code has run; the agent sets the driver's cap on it where the node can.
//
// A refusal, or an agent that cannot be reached, fails the request with the reason, which the kubelet shows as
// the container's CreateContainerError / RunContainerError: fail closed. Containers of other pods never reach
// the agent, so a node whose agent is down still runs everything else (the agent's own pod included).
//
// Beside containerd on a host it exits when containerd drops it, for its supervisor to restart it; in the node agent's
// DaemonSet (--reconnect) it waits for containerd's NRI socket and connects again itself, so a node without NRI keeps
// the agent's pod Ready and a containerd restart is rejoined within the interval.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
)

// KAI's annotations that make a pod GPU-sharing (kai_isolator.shared.contract.GPU_FRACTION_ANNOTATION and
// GPU_MEMORY_ANNOTATION).
var sharingAnnotations = []string{"gpu-fraction", "gpu-memory"}

// request is what the agent's decision socket reads: kai_isolator.services.nodeagent.creation.CreationRequest.
type request struct {
	Event       string            `json:"event"` // "create" or "start"
	PodUID      string            `json:"pod_uid"`
	Namespace   string            `json:"namespace"`
	Pod         string            `json:"pod"`
	Container   string            `json:"container"`
	Env         []string          `json:"env"`
	CgroupsPath string            `json:"cgroups_path"`
	Pid         uint32            `json:"pid"`
	Annotations map[string]string `json:"annotations"`
}

// reply is the agent's answer: kai_isolator.services.nodeagent.creation.CreationReply.
type reply struct {
	Allow     bool              `json:"allow"`
	Reason    string            `json:"reason"`
	RemoveEnv []string          `json:"remove_env"`
	SetEnv    map[string]string `json:"set_env"`
}

type plugin struct {
	socket  string
	timeout time.Duration
}

func sharing(pod *api.PodSandbox) bool {
	for _, name := range sharingAnnotations {
		if _, ok := pod.GetAnnotations()[name]; ok {
			return true
		}
	}
	return false
}

func (p *plugin) ask(ctx context.Context, req request) (reply, error) {
	var answer reply
	ctx, cancel := context.WithTimeout(ctx, p.timeout)
	defer cancel()
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "unix", p.socket)
	if err != nil {
		return answer, fmt.Errorf("kai-isolator node agent unreachable at %s, container held back (fail closed): %w", p.socket, err)
	}
	defer conn.Close()
	if deadline, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(deadline)
	}
	line, err := json.Marshal(req)
	if err != nil {
		return answer, err
	}
	if _, err = conn.Write(append(line, '\n')); err != nil {
		return answer, fmt.Errorf("kai-isolator node agent: sending the request: %w", err)
	}
	read, err := bufio.NewReader(conn).ReadBytes('\n')
	if err != nil {
		return answer, fmt.Errorf("kai-isolator node agent gave no answer in %s, container held back (fail closed): %w", p.timeout, err)
	}
	if err = json.Unmarshal(read, &answer); err != nil {
		return answer, fmt.Errorf("kai-isolator node agent: unreadable answer: %w", err)
	}
	if !answer.Allow {
		return answer, errors.New("kai-isolator: " + answer.Reason)
	}
	return answer, nil
}

func describe(event string, pod *api.PodSandbox, ctr *api.Container) request {
	return request{Event: event, PodUID: pod.GetUid(), Namespace: pod.GetNamespace(), Pod: pod.GetName(),
		Container: ctr.GetName(), Env: ctr.GetEnv(), CgroupsPath: ctr.GetLinux().GetCgroupsPath(), Pid: ctr.GetPid(),
		Annotations: pod.GetAnnotations()}
}

// CreateContainer strips what the tenant set and sets the grant's values, once the grant exists.
func (p *plugin) CreateContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	if !sharing(pod) {
		return nil, nil, nil
	}
	answer, err := p.ask(ctx, describe("create", pod, ctr))
	if err != nil {
		return nil, nil, err
	}
	adjust := &api.ContainerAdjustment{}
	// The removals keep the tenant's names from the request later NRI plugins see; NRI v0.12.3's runtime side does
	// not forward them to the OCI spec, so the agent answers a value (empty where the grant has none) for every
	// name it removes, and the addition, applied after the removal, replaces the variable in place.
	for _, name := range answer.RemoveEnv {
		adjust.RemoveEnv(name)
	}
	for name, value := range answer.SetEnv {
		adjust.AddEnv(name, value)
	}
	return adjust, nil, nil
}

// StartContainer lets the agent cap the container's leaf cgroup before its first instruction runs.
func (p *plugin) StartContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) error {
	if !sharing(pod) {
		return nil
	}
	_, err := p.ask(ctx, describe("start", pod, ctr))
	return err
}

func main() {
	name := flag.String("name", "kai-isolator", "the plugin's name, as NRI's required-plugins lists it")
	index := flag.String("idx", "10", "the plugin's index (its order among NRI plugins)")
	nriSocket := flag.String("nri-socket", "/var/run/nri/nri.sock", "containerd's NRI socket")
	agentSocket := flag.String("agent-socket", "/var/run/kai-isolator/nri.sock", "the node agent's decision socket")
	timeout := flag.Duration("timeout", 1800*time.Millisecond, "how long one question to the agent may take; keep it under containerd's plugin_request_timeout")
	reconnect := flag.Duration("reconnect", 0, "when containerd's NRI socket is absent or containerd drops the plugin (a restart), "+
		"connect again after this long instead of exiting; 0 exits, for a supervisor to restart it")
	flag.Parse()

	p := &plugin{socket: *agentSocket, timeout: *timeout}
	opts := []stub.Option{stub.WithPluginName(*name), stub.WithPluginIdx(*index), stub.WithSocketPath(*nriSocket),
		// Past the request timeout the runtime fails the request instead of creating the container without us.
		stub.WithFailurePolicy(&api.FailurePolicy{FailRequest: true})}
	said := ""
	for {
		if *reconnect > 0 {
			if _, err := os.Stat(*nriSocket); err != nil {
				// No NRI on this node (yet): wait quietly, without a stub (each one logs its creation).
				if message := fmt.Sprint(err); message != said {
					fmt.Fprintf(os.Stderr, "kai-isolator-nri: waiting for containerd's NRI socket: %s\n", message)
					said = message
				}
				time.Sleep(*reconnect)
				continue
			}
		}
		// A fresh stub per connection: one that lost its runtime is not meant to be started again.
		s, err := stub.New(p, opts...)
		if err != nil { // a bad name or index: no retry mends it
			fmt.Fprintf(os.Stderr, "kai-isolator-nri: %v\n", err)
			os.Exit(1)
		}
		began := time.Now()
		err = s.Run(context.Background())
		if *reconnect <= 0 {
			fmt.Fprintf(os.Stderr, "kai-isolator-nri: %v\n", err)
			os.Exit(1)
		}
		// In a DaemonSet beside the agent: a node whose containerd runs no NRI keeps the pod Ready (nothing to join),
		// and a containerd restart is rejoined within the interval, not after the kubelet's growing back-off. Said
		// once per kind of failure, so a node without NRI does not log every interval.
		if time.Since(began) > *reconnect {
			said = "" // it was connected: whatever ended it is news
		}
		if message := fmt.Sprint(err); message != said {
			fmt.Fprintf(os.Stderr, "kai-isolator-nri: %s; connecting again every %s\n", message, *reconnect)
			said = message
		}
		time.Sleep(*reconnect)
	}
}
