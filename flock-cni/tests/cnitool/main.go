// cnitool: a minimal libcni driver for flock's end-to-end tests and benchmarks.
//
// It runs a network config list the way containerd and CRI-O do (libcni
// ConfListFromFile + AddNetworkList / CheckNetworkList / DelNetworkList), so the
// plugins see exactly what a real runtime passes them. Built offline in GOPATH mode
// from Debian's golang-github-appc-cni-dev by scripts/prereqs/20-cni.sh.
//
// Usage:
//
//	cnitool add|check|del CONFLIST NETNS CONTAINER_ID IFNAME
//	cnitool bench N CONFLIST NETNS CONTAINER_ID_PREFIX IFNAME
//
// Environment: CNI_PATH (plugin directories, ':'-separated), CNI_CACHE_DIR (libcni's
// result cache; required so tests never touch /var/lib/cni), CNI_ARGS_K8S (optional
// "K8S_POD_NAME=a;K8S_POD_NAMESPACE=b;K8S_POD_UID=c"), CNI_POD_ANNOTATIONS (optional
// JSON object of pod annotations, passed as the "io.kubernetes.cri.pod-annotations"
// capability argument the way containerd does: libcni hands it to each plugin that
// declares that capability, in its runtimeConfig).
//
// add prints the result JSON on stdout. bench runs N times ADD then DEL and prints
// one line of JSON: {"n":N,"add_us":[...]} with each ADD's latency in microseconds.
// Errors go to stderr with exit status 1.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
)

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "cnitool: "+format+"\n", args...)
	os.Exit(1)
}

func runtimeConf(netns, id, ifname string) *libcni.RuntimeConf {
	rt := &libcni.RuntimeConf{ContainerID: id, NetNS: netns, IfName: ifname}
	if a := os.Getenv("CNI_ARGS_K8S"); a != "" {
		for _, kv := range strings.Split(a, ";") {
			parts := strings.SplitN(kv, "=", 2)
			if len(parts) == 2 {
				rt.Args = append(rt.Args, [2]string{parts[0], parts[1]})
			}
		}
	}
	if a := os.Getenv("CNI_POD_ANNOTATIONS"); a != "" {
		var annotations map[string]string
		if err := json.Unmarshal([]byte(a), &annotations); err != nil {
			fail("CNI_POD_ANNOTATIONS must be a JSON object of strings: %v", err)
		}
		rt.CapabilityArgs = map[string]interface{}{"io.kubernetes.cri.pod-annotations": annotations}
	}
	return rt
}

func main() {
	if len(os.Args) < 2 {
		fail("usage: cnitool add|check|del CONFLIST NETNS CONTAINER_ID IFNAME | bench N CONFLIST NETNS ID_PREFIX IFNAME")
	}
	cacheDir := os.Getenv("CNI_CACHE_DIR")
	if cacheDir == "" {
		fail("CNI_CACHE_DIR must be set (libcni's result cache)")
	}
	cni := libcni.NewCNIConfigWithCacheDir(filepath.SplitList(os.Getenv("CNI_PATH")), cacheDir, nil)
	ctx := context.Background()
	switch os.Args[1] {
	case "add", "check", "del":
		if len(os.Args) != 6 {
			fail("usage: cnitool %s CONFLIST NETNS CONTAINER_ID IFNAME", os.Args[1])
		}
		list, err := libcni.ConfListFromFile(os.Args[2])
		if err != nil {
			fail("loading %s: %v", os.Args[2], err)
		}
		rt := runtimeConf(os.Args[3], os.Args[4], os.Args[5])
		switch os.Args[1] {
		case "add":
			res, err := cni.AddNetworkList(ctx, list, rt)
			if err != nil {
				fail("ADD: %v", err)
			}
			if err := res.Print(); err != nil {
				fail("printing result: %v", err)
			}
		case "check":
			if err := cni.CheckNetworkList(ctx, list, rt); err != nil {
				fail("CHECK: %v", err)
			}
		case "del":
			if err := cni.DelNetworkList(ctx, list, rt); err != nil {
				fail("DEL: %v", err)
			}
		}
	case "bench":
		if len(os.Args) != 7 {
			fail("usage: cnitool bench N CONFLIST NETNS ID_PREFIX IFNAME")
		}
		n, err := strconv.Atoi(os.Args[2])
		if err != nil || n <= 0 {
			fail("bad N %q", os.Args[2])
		}
		list, err := libcni.ConfListFromFile(os.Args[3])
		if err != nil {
			fail("loading %s: %v", os.Args[3], err)
		}
		lat := make([]int64, 0, n)
		for i := 0; i < n; i++ {
			rt := runtimeConf(os.Args[4], fmt.Sprintf("%s%d", os.Args[5], i), os.Args[6])
			start := time.Now()
			if _, err := cni.AddNetworkList(ctx, list, rt); err != nil {
				fail("ADD #%d: %v", i, err)
			}
			lat = append(lat, time.Since(start).Microseconds())
			if err := cni.DelNetworkList(ctx, list, rt); err != nil {
				fail("DEL #%d: %v", i, err)
			}
		}
		out, _ := json.Marshal(map[string]interface{}{"n": n, "add_us": lat})
		fmt.Println(string(out))
	default:
		fail("unknown command %q", os.Args[1])
	}
}
