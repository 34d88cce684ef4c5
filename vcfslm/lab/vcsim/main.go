// Command vcsim is the lab's vCenter simulator: govmomi's simulator.VPX model
// with hosts shaped like the brief's ThinkAgile VX650 V4, TLS from a local CA,
// fixed credentials, optional per-method latency, REST endpoints and a VM
// template created at start-up.
//
// -api makes it advertise a newer vSphere API (About.ApiVersion, the hosts'
// product API and /sdk/vimServiceVersions.xml with every older release as a
// prior version), so pyVmomi negotiates that release. govmomi 0.24 has no
// ConfigSpec.virtualNuma: its decoder skips the element, so every
// ReconfigVM_Task / CloneVM_Task body carrying virtualNuma or a numa.* advanced
// setting is recorded as it arrived, one JSON line per call, in -record-file.
//
// -throttle METHOD=K answers HTTP 503 Service Unavailable (what vCenter's reverse
// proxy answers when it sheds load) to a METHOD call while K calls of it are already
// being served, so clients' backoff can be tested; K=0 refuses every call of METHOD.
// Each refusal is logged ("vcsim: throttled ...").
//
// Built in GOPATH mode against Debian's golang-github-vmware-govmomi-dev
// (govmomi 0.24.2). When ready it prints one JSON line on stdout (and writes it
// to -ready-file when given) with the URL and the CA file; SIGTERM stops it.
package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"io/ioutil"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vmware/govmomi/find"
	"github.com/vmware/govmomi/object"
	"github.com/vmware/govmomi/simulator"
	"github.com/vmware/govmomi/simulator/esx"
	"github.com/vmware/govmomi/vim25"
	"github.com/vmware/govmomi/vim25/types"

	// REST (vAPI), lookup, STS and PBM endpoints, registered when RegisterEndpoints is on.
	_ "github.com/vmware/govmomi/lookup/simulator"
	_ "github.com/vmware/govmomi/pbm/simulator"
	_ "github.com/vmware/govmomi/sts/simulator"
	_ "github.com/vmware/govmomi/vapi/simulator"
)

type options struct {
	listen       string
	clusters     int
	hosts        int
	standalone   int
	vms          int
	portgroups   int
	datastores   int
	username     string
	password     string
	tlsDir       string
	delay        int
	methodDelay  string
	template     string
	hostHardware string
	readyFile    string
	api          string
	recordFile   string
	throttle     string
}

// ready is the machine-readable line printed once the server accepts requests.
type ready struct {
	URL        string `json:"url"`
	Host       string `json:"host"`
	Port       int    `json:"port"`
	CAFile     string `json:"ca_file"`
	Username   string `json:"username"`
	Template   string `json:"template"`
	APIVersion string `json:"api_version"`
	Hardware   string `json:"hardware_version"`
	Records    string `json:"record_file"`
	Hosts      int    `json:"hosts_per_cluster"`
	Clusters   int    `json:"clusters"`
	PID        int    `json:"pid"`
}

func parseFlags() options {
	var o options
	flag.StringVar(&o.listen, "listen", "127.0.0.1:0", "listen address host:port (port 0 = a free port)")
	flag.IntVar(&o.clusters, "cluster", 1, "clusters per datacenter")
	flag.IntVar(&o.hosts, "host", 4, "ESXi hosts per cluster")
	flag.IntVar(&o.standalone, "standalone-host", 0, "standalone ESXi hosts per datacenter")
	flag.IntVar(&o.vms, "vm", 0, "extra simulator VMs per resource pool")
	flag.IntVar(&o.portgroups, "pg", 1, "distributed port groups per datacenter (DC0_DVPG0, ...)")
	flag.IntVar(&o.datastores, "ds", 1, "local datastores (LocalDS_0, ...)")
	flag.StringVar(&o.username, "username", "administrator@vsphere.local", "login user")
	flag.StringVar(&o.password, "password", "", "login password (default: $VCSIM_PASSWORD)")
	flag.StringVar(&o.tlsDir, "tls-dir", "", "folder for ca.pem / ca-key.pem (reused when present); required")
	flag.IntVar(&o.delay, "delay", 0, "delay in ms added to every SOAP call")
	flag.StringVar(&o.methodDelay, "method-delay", "", "per-method delay in ms, e.g. CloneVM_Task=1000,PowerOnVM_Task=1000")
	flag.StringVar(&o.template, "template", "vcfslm-template", "name of a VM template to create at start-up (empty: none)")
	flag.StringVar(&o.hostHardware, "host-hardware", "vx650v4", "host hardware model: vx650v4 | vcsim")
	flag.StringVar(&o.readyFile, "ready-file", "", "also write the ready line (JSON) to this file, atomically")
	flag.StringVar(&o.api, "api", "6.5", "vSphere API version to advertise: "+strings.Join(apiNames(), " | "))
	flag.StringVar(&o.recordFile, "record-file", "", "append recorded vNUMA reconfigure/clone bodies here (JSON lines)")
	flag.StringVar(&o.throttle, "throttle", "", "answer HTTP 503 to METHOD while K calls of it are in flight, e.g. CloneVM_Task=2 (0: always)")
	flag.Parse()
	if o.password == "" {
		o.password = os.Getenv("VCSIM_PASSWORD")
	}
	return o
}

// parseMethodDelay turns "A=1,B=2" into a map of method name to milliseconds.
func parseMethodDelay(spec string) (map[string]int, error) {
	return parseMethodInts("-method-delay", "milliseconds", spec)
}

// parseMethodInts turns "A=1,B=2" into a map of method name to a non-negative integer.
func parseMethodInts(flagName, unit, spec string) (map[string]int, error) {
	delays := map[string]int{}
	for _, item := range strings.Split(spec, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		parts := strings.SplitN(item, "=", 2)
		if len(parts) != 2 {
			return nil, fmt.Errorf("%s: %q is not METHOD=N", flagName, item)
		}
		ms, err := strconv.Atoi(strings.TrimSpace(parts[1]))
		if err != nil || ms < 0 {
			return nil, fmt.Errorf("%s: %q: %s must be a non-negative integer", flagName, item, unit)
		}
		delays[strings.TrimSpace(parts[0])] = ms
	}
	return delays, nil
}

// useVX650V4Hardware reshapes the simulator's host template (default: 2 cores,
// 4 GB, one NUMA node) into a ThinkAgile VX650 V4: 2 x Xeon 6747P (48 cores,
// HT), sub-NUMA clustering -> 4 NUMA nodes, 1.5 TB. Must run before Create().
func useVX650V4Hardware() {
	const (
		sockets        = 2
		coresPerSocket = 48
		threadsPerCore = 2
		numaNodes      = 4
		hz             = int64(2_700_000_000)
		cpuModel       = "Intel(R) Xeon(R) 6747P"
		vendor         = "Lenovo"
		model          = "ThinkAgile VX650 V4"
	)
	memory := int64(1536) << 30 // 1.5 TiB
	threads := sockets * coresPerSocket * threadsPerCore
	threadsPerNode := threads / numaNodes
	threadsPerSocket := threads / sockets

	hw := esx.HostHardwareInfo
	hw.SystemInfo.Vendor = vendor
	hw.SystemInfo.Model = model
	hw.CpuInfo = types.HostCpuInfo{
		NumCpuPackages: sockets,
		NumCpuCores:    sockets * coresPerSocket,
		NumCpuThreads:  int16(threads),
		Hz:             hz,
	}
	features := hw.CpuPkg[0].CpuFeature
	hw.CpuPkg = nil
	for s := 0; s < sockets; s++ {
		ids := make([]int16, 0, threadsPerSocket)
		for t := s * threadsPerSocket; t < (s+1)*threadsPerSocket; t++ {
			ids = append(ids, int16(t))
		}
		hw.CpuPkg = append(hw.CpuPkg, types.HostCpuPackage{
			Index:       int16(s),
			Vendor:      "intel",
			Hz:          hz,
			BusHz:       100_000_000,
			Description: cpuModel,
			ThreadId:    ids,
			CpuFeature:  features,
		})
	}
	hw.MemorySize = memory
	// ESXi numbers hyper-thread siblings next to each other, so each SNC node
	// owns a contiguous block of logical CPUs (24 cores = 48 threads).
	numa := &types.HostNumaInfo{Type: "NUMA", NumNodes: numaNodes}
	nodeMemory := memory / numaNodes
	for n := 0; n < numaNodes; n++ {
		ids := make([]int16, 0, threadsPerNode)
		for t := n * threadsPerNode; t < (n+1)*threadsPerNode; t++ {
			ids = append(ids, int16(t))
		}
		numa.NumaNode = append(numa.NumaNode, types.HostNumaNode{
			TypeId:            byte(n),
			CpuID:             ids,
			MemoryRangeBegin:  int64(n) * nodeMemory,
			MemoryRangeLength: nodeMemory,
		})
	}
	hw.NumaInfo = numa

	summary := esx.HostSystem.Summary.Hardware
	summary.Vendor = vendor
	summary.Model = model
	summary.MemorySize = memory
	summary.CpuModel = cpuModel
	summary.CpuMhz = int32(hz / 1_000_000)
	summary.NumCpuPkgs = sockets
	summary.NumCpuCores = sockets * coresPerSocket
	summary.NumCpuThreads = int16(threads)

	esx.HostConfigInfo.HyperThread = &types.HostHyperThreadScheduleInfo{
		Available: true, Active: true, Config: true,
	}
}

// loadOrCreateCA returns the lab CA, reusing dir/ca.pem + dir/ca-key.pem so
// clients keep trusting a restarted simulator.
func loadOrCreateCA(dir string) (*x509.Certificate, *ecdsa.PrivateKey, string, error) {
	certPath := filepath.Join(dir, "ca.pem")
	keyPath := filepath.Join(dir, "ca-key.pem")
	if certPEM, err := ioutil.ReadFile(certPath); err == nil {
		if keyPEM, err := ioutil.ReadFile(keyPath); err == nil {
			cb, _ := pem.Decode(certPEM)
			kb, _ := pem.Decode(keyPEM)
			if cb != nil && kb != nil {
				cert, cerr := x509.ParseCertificate(cb.Bytes)
				key, kerr := x509.ParseECPrivateKey(kb.Bytes)
				if cerr == nil && kerr == nil && time.Now().Before(cert.NotAfter) {
					return cert, key, certPath, nil
				}
			}
		}
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, "", err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          randomSerial(),
		Subject:               pkix.Name{CommonName: "vcfslm lab CA", Organization: []string{"vcfslm"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().AddDate(5, 0, 0),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, "", err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, "", err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, "", err
	}
	if err := writeFileAtomic(keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return nil, nil, "", err
	}
	if err := writeFileAtomic(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return nil, nil, "", err
	}
	return cert, key, certPath, nil
}

// serverCertificate issues a fresh server certificate for the listen host,
// 127.0.0.1 and localhost, signed by the lab CA.
func serverCertificate(ca *x509.Certificate, caKey *ecdsa.PrivateKey, host string) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	ips := []net.IP{net.ParseIP("127.0.0.1")}
	dns := []string{"localhost"}
	if ip := net.ParseIP(host); ip != nil {
		if !ip.Equal(ips[0]) {
			ips = append(ips, ip)
		}
	} else if host != "" && host != "localhost" {
		dns = append(dns, host)
	}
	tmpl := &x509.Certificate{
		SerialNumber: randomSerial(),
		Subject:      pkix.Name{CommonName: "vcsim", Organization: []string{"vcfslm lab"}},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().AddDate(1, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  ips,
		DNSNames:     dns,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der, ca.Raw}, PrivateKey: key}, nil
}

func randomSerial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		panic(err)
	}
	return n
}

func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp, err := ioutil.TempFile(filepath.Dir(path), "."+filepath.Base(path)+".")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// createTemplate makes a powered-off VM shaped like a small Linux template
// (2 vCPUs, 4 GB, one disk, one NIC on "VM Network") and marks it a template.
func createTemplate(ctx context.Context, c *vim25.Client, name string) error {
	finder := find.NewFinder(c, true)
	dc, err := finder.DefaultDatacenter(ctx)
	if err != nil {
		return err
	}
	finder.SetDatacenter(dc)
	folders, err := dc.Folders(ctx)
	if err != nil {
		return err
	}
	pools, err := finder.ResourcePoolList(ctx, "*")
	if err != nil || len(pools) == 0 {
		return fmt.Errorf("no resource pool for the template: %v", err)
	}
	hosts, err := finder.HostSystemList(ctx, "*")
	if err != nil || len(hosts) == 0 {
		return fmt.Errorf("no host for the template: %v", err)
	}
	pool, host := pools[0], hosts[0]
	if cluster, cerr := finder.DefaultClusterComputeResource(ctx); cerr == nil {
		if p, perr := cluster.ResourcePool(ctx); perr == nil {
			pool = p
		}
		if hs, herr := cluster.Hosts(ctx); herr == nil && len(hs) > 0 {
			host = hs[0]
		}
	}
	network, err := finder.Network(ctx, "VM Network")
	if err != nil {
		return err
	}
	backing, err := network.EthernetCardBackingInfo(ctx)
	if err != nil {
		return err
	}
	datastores, err := finder.DatastoreList(ctx, "*")
	if err != nil || len(datastores) == 0 {
		return fmt.Errorf("no datastore for the template: %v", err)
	}
	dsName := datastores[0].Name()

	var devices object.VirtualDeviceList
	scsi, err := devices.CreateSCSIController("pvscsi")
	if err != nil {
		return err
	}
	devices = append(devices, scsi)
	disk := devices.CreateDisk(scsi.(types.BaseVirtualController), datastores[0].Reference(),
		fmt.Sprintf("[%s] %s/%s.vmdk", dsName, name, name))
	disk.CapacityInKB = 16 * 1024 * 1024
	devices = append(devices, disk)
	nic, err := devices.CreateEthernetCard("vmxnet3", backing)
	if err != nil {
		return err
	}
	devices = append(devices, nic)
	changes, err := devices.ConfigSpec(types.VirtualDeviceConfigSpecOperationAdd)
	if err != nil {
		return err
	}

	spec := types.VirtualMachineConfigSpec{
		Name:              name,
		GuestId:           string(types.VirtualMachineGuestOsIdentifierUbuntu64Guest),
		NumCPUs:           2,
		NumCoresPerSocket: 2,
		MemoryMB:          4096,
		Version:           esx.HardwareVersion,
		Files:             &types.VirtualMachineFileInfo{VmPathName: fmt.Sprintf("[%s]", dsName)},
		DeviceChange:      changes,
	}
	task, err := folders.VmFolder.CreateVM(ctx, spec, pool, host)
	if err != nil {
		return err
	}
	info, err := task.WaitForResult(ctx, nil)
	if err != nil {
		return err
	}
	vm := object.NewVirtualMachine(c, info.Result.(types.ManagedObjectReference))
	return vm.MarkAsTemplate(ctx)
}

// apiReleases lists the vSphere API version ids pyVmomi knows (newest first) with
// the newest virtual hardware each release creates.
var apiReleases = []struct{ id, hardware string }{
	{"9.0.0.0", "vmx-22"}, {"8.0.3.0", "vmx-21"}, {"8.0.2.0", "vmx-21"}, {"8.0.1.0", "vmx-20"},
	{"8.0.0.2", "vmx-20"}, {"8.0.0.1", "vmx-20"}, {"8.0.0.0", "vmx-20"}, {"7.0.3.2", "vmx-19"},
	{"7.0.3.1", "vmx-19"}, {"7.0.3.0", "vmx-19"}, {"7.0.2.1", "vmx-19"}, {"7.0.2.0", "vmx-19"},
	{"7.0.1.1", "vmx-18"}, {"7.0.1.0", "vmx-18"}, {"7.0.0.2", "vmx-17"}, {"7.0.0.0", "vmx-17"},
	{"6.7.3", "vmx-15"}, {"6.7.2", "vmx-15"}, {"6.7.1", "vmx-14"}, {"6.7", "vmx-14"},
	{"6.5", "vmx-13"}, {"6.0", "vmx-11"}, {"5.5", "vmx-10"},
}

func apiNames() []string {
	names := make([]string, 0, len(apiReleases))
	for _, r := range apiReleases {
		names = append(names, r.id)
	}
	return names
}

// findAPI resolves "8.0.3" (or "8.0.3.0") to its index in apiReleases.
func findAPI(name string) (int, error) {
	for i, r := range apiReleases {
		if trimZeros(r.id) == trimZeros(name) {
			return i, nil
		}
	}
	return 0, fmt.Errorf("-api: unknown vSphere API %q (one of %s)", name, strings.Join(apiNames(), ", "))
}

// trimZeros drops trailing ".0" parts: "8.0.3.0" -> "8.0.3", "7.0.0.0" -> "7".
func trimZeros(v string) string {
	for strings.HasSuffix(v, ".0") {
		v = strings.TrimSuffix(v, ".0")
	}
	return v
}

// advertiseAPI makes the model report release i: service content, hosts, virtual hardware.
// Must run before Create().
func advertiseAPI(model *simulator.Model, i int) {
	id := apiReleases[i].id
	model.ServiceContent.About.ApiVersion = id
	esx.HostConfigInfo.Product.ApiVersion = id
	esx.HardwareVersion = apiReleases[i].hardware
}

// serviceVersions serves /sdk/vimServiceVersions.xml: release i, every older one as prior.
func serviceVersions(i int) http.HandlerFunc {
	var prior strings.Builder
	for _, r := range apiReleases[i+1:] {
		fmt.Fprintf(&prior, "   <version>%s</version>\n", r.id)
	}
	doc := fmt.Sprintf(`<?xml version="1.0" encoding="UTF-8"?>
<namespaces version="1.0">
 <namespace>
  <name>urn:vim25</name>
  <version>%s</version>
  <priorVersions>
%s  </priorVersions>
 </namespace>
</namespaces>
`, apiReleases[i].id, prior.String())
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/xml; charset=utf-8")
		_, _ = w.Write([]byte(doc))
	}
}

// soapRecord is one recorded call: what the spec carried for vNUMA, as it arrived.
type soapRecord struct {
	Method           string            `json:"method"`
	Moref            string            `json:"moref"`
	Name             string            `json:"name,omitempty"` // CloneVM_Task: the new VM's name
	SOAPAction       string            `json:"soap_action"`
	VirtualNuma      string            `json:"virtual_numa,omitempty"`
	CoresPerNumaNode int               `json:"cores_per_numa_node,omitempty"`
	ExtraConfig      map[string]string `json:"extra_config,omitempty"`
}

var (
	reMethod      = regexp.MustCompile(`<(ReconfigVM_Task|CloneVM_Task)\b`)
	reThis        = regexp.MustCompile(`<_this\b[^>]*>([^<]*)</_this>`)
	reCloneName   = regexp.MustCompile(`(?s)<CloneVM_Task\b.*?<name>([^<]*)</name>`)
	reVirtualNuma = regexp.MustCompile(`(?s)<virtualNuma\b.*?</virtualNuma>`)
	reCores       = regexp.MustCompile(`<coresPerNumaNode>(\d+)</coresPerNumaNode>`)
	reOption      = regexp.MustCompile(`(?s)<extraConfig\b[^>]*>\s*<key>(numa\.[^<]*)</key>\s*<value\b[^>]*>([^<]*)</value>`)
)

// parseRecord extracts the vNUMA content of a ReconfigVM_Task / CloneVM_Task body (nil: none).
func parseRecord(body []byte, action string) *soapRecord {
	m := reMethod.FindSubmatch(body)
	if m == nil {
		return nil
	}
	rec := &soapRecord{Method: string(m[1]), SOAPAction: action}
	if vn := reVirtualNuma.Find(body); vn != nil {
		rec.VirtualNuma = string(vn)
		if c := reCores.FindSubmatch(vn); c != nil {
			rec.CoresPerNumaNode, _ = strconv.Atoi(string(c[1]))
		}
	}
	for _, opt := range reOption.FindAllSubmatch(body, -1) {
		if rec.ExtraConfig == nil {
			rec.ExtraConfig = map[string]string{}
		}
		rec.ExtraConfig[string(opt[1])] = string(opt[2])
	}
	if rec.VirtualNuma == "" && rec.ExtraConfig == nil {
		return nil
	}
	if t := reThis.FindSubmatch(body); t != nil {
		rec.Moref = string(t[1])
	}
	if n := reCloneName.FindSubmatch(body); n != nil {
		rec.Name = string(n[1])
	}
	return rec
}

// reBodyMethod finds the called method: the first element inside the SOAP body.
var reBodyMethod = regexp.MustCompile(`<(?:[A-Za-z0-9_]+:)?Body\b[^>]*>\s*<(?:[A-Za-z0-9_]+:)?([A-Za-z0-9_]+)`)

// throttle counts the calls of each limited method being served and refuses one over its limit.
type throttle struct {
	limits   map[string]int
	mu       sync.Mutex
	inFlight map[string]int
	refused  map[string]int
}

func newThrottle(limits map[string]int) *throttle {
	return &throttle{limits: limits, inFlight: map[string]int{}, refused: map[string]int{}}
}

// enter admits a call of method (true) or counts a refusal (false); admitted calls must leave.
func (t *throttle) enter(method string) bool {
	limit, ok := t.limits[method]
	if !ok {
		return true
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.inFlight[method] >= limit {
		t.refused[method]++
		log.Printf("vcsim: throttled %s (%d in flight, limit %d): refusal %d answered 503",
			method, t.inFlight[method], limit, t.refused[method])
		return false
	}
	t.inFlight[method]++
	return true
}

func (t *throttle) leave(method string) {
	if _, ok := t.limits[method]; !ok {
		return
	}
	t.mu.Lock()
	t.inFlight[method]--
	t.mu.Unlock()
}

// recorder wraps the simulator's handler: it serves the advertised versions document,
// appends every vNUMA-carrying reconfigure/clone body to a file and refuses calls over
// the throttle's limits, then passes the call on.
type recorder struct {
	next     http.Handler
	versions http.Handler
	file     string
	throttle *throttle
	mu       sync.Mutex
}

func (rw *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/sdk/vimServiceVersions.xml" {
		rw.versions.ServeHTTP(w, r)
		return
	}
	limited := rw.throttle != nil && len(rw.throttle.limits) > 0
	if r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/sdk") && (rw.file != "" || limited) {
		body, err := ioutil.ReadAll(r.Body)
		_ = r.Body.Close()
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		if limited {
			if m := reBodyMethod.FindSubmatch(body); m != nil {
				method := string(m[1])
				if !rw.throttle.enter(method) {
					w.Header().Set("Retry-After", "1")
					http.Error(w, "Service Unavailable", http.StatusServiceUnavailable)
					return
				}
				defer rw.throttle.leave(method)
			}
		}
		if rw.file != "" {
			if rec := parseRecord(body, strings.Trim(r.Header.Get("SOAPAction"), `"`)); rec != nil {
				rw.append(rec)
			}
		}
		r.Body = ioutil.NopCloser(bytes.NewReader(body))
	}
	rw.next.ServeHTTP(w, r)
}

func (rw *recorder) append(rec *soapRecord) {
	var line bytes.Buffer
	enc := json.NewEncoder(&line)
	enc.SetEscapeHTML(false) // keep the element readable: <virtualNuma>...
	if err := enc.Encode(rec); err != nil {
		log.Printf("vcsim: record: %v", err)
		return
	}
	rw.mu.Lock()
	defer rw.mu.Unlock()
	f, err := os.OpenFile(rw.file, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		log.Printf("vcsim: record: %v", err)
		return
	}
	defer f.Close()
	if _, err := f.Write(line.Bytes()); err != nil {
		log.Printf("vcsim: record: %v", err)
	}
}

func run(o options) error {
	if o.tlsDir == "" {
		return errors.New("-tls-dir is required")
	}
	if o.username == "" || o.password == "" {
		return errors.New("a username and a password (-password or $VCSIM_PASSWORD) are required")
	}
	if o.hosts < 1 || o.clusters < 1 {
		return errors.New("-host and -cluster must be at least 1")
	}
	delays, err := parseMethodDelay(o.methodDelay)
	if err != nil {
		return err
	}
	limits, err := parseMethodInts("-throttle", "the limit", o.throttle)
	if err != nil {
		return err
	}
	api, err := findAPI(o.api)
	if err != nil {
		return err
	}
	switch o.hostHardware {
	case "vx650v4":
		useVX650V4Hardware()
	case "vcsim":
	default:
		return fmt.Errorf("-host-hardware: unknown model %q (vx650v4 | vcsim)", o.hostHardware)
	}
	if err := os.MkdirAll(o.tlsDir, 0o700); err != nil {
		return err
	}
	if abs, err := filepath.Abs(o.tlsDir); err == nil {
		o.tlsDir = abs
	}
	ca, caKey, caFile, err := loadOrCreateCA(o.tlsDir)
	if err != nil {
		return fmt.Errorf("lab CA: %v", err)
	}
	listenHost, _, err := net.SplitHostPort(o.listen)
	if err != nil {
		return fmt.Errorf("-listen: %v", err)
	}
	cert, err := serverCertificate(ca, caKey, listenHost)
	if err != nil {
		return fmt.Errorf("server certificate: %v", err)
	}
	// Fail with a message rather than the simulator's panic when the port is taken.
	if probe, err := net.Listen("tcp", o.listen); err != nil {
		return fmt.Errorf("cannot listen on %s: %v", o.listen, err)
	} else {
		probe.Close()
	}

	model := simulator.VPX()
	model.Datacenter = 1
	model.Cluster = o.clusters
	model.ClusterHost = o.hosts
	model.Host = o.standalone
	model.Machine = o.vms
	model.Portgroup = o.portgroups
	model.Datastore = o.datastores
	model.Autostart = true
	advertiseAPI(model, api)
	if err := model.Create(); err != nil {
		return fmt.Errorf("simulator model: %v", err)
	}
	defer model.Remove()

	ctx := context.Background()
	if o.template != "" {
		// In-process client: no network, no latency, an internal session.
		client, err := vim25.NewClient(ctx, model.Service)
		if err != nil {
			return err
		}
		if err := createTemplate(ctx, client, o.template); err != nil {
			return fmt.Errorf("template %s: %v", o.template, err)
		}
	}

	model.Service.Listen = &url.URL{Host: o.listen, User: url.UserPassword(o.username, o.password)}
	model.Service.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	model.Service.RegisterEndpoints = true
	server := model.Service.NewServer()
	// Set before the ready line is written, so before any client can call.
	server.Config.Handler = &recorder{next: server.Config.Handler, versions: serviceVersions(api),
		file: o.recordFile, throttle: newThrottle(limits)}

	// Latency starts only now, so start-up (template creation) stays fast.
	model.DelayConfig.Delay = o.delay
	model.DelayConfig.MethodDelay = delays

	addr := server.Listener.Addr().(*net.TCPAddr)
	u := url.URL{Scheme: "https", Host: net.JoinHostPort(addr.IP.String(), strconv.Itoa(addr.Port)), Path: "/sdk"}
	line, err := json.Marshal(ready{
		URL:        u.String(),
		Host:       addr.IP.String(),
		Port:       addr.Port,
		CAFile:     caFile,
		Username:   o.username,
		Template:   o.template,
		APIVersion: model.ServiceContent.About.ApiVersion,
		Hardware:   esx.HardwareVersion,
		Records:    o.recordFile,
		Hosts:      o.hosts,
		Clusters:   o.clusters,
		PID:        os.Getpid(),
	})
	if err != nil {
		return err
	}
	if o.readyFile != "" {
		if err := writeFileAtomic(o.readyFile, append(line, '\n'), 0o644); err != nil {
			return err
		}
	}
	fmt.Println(string(line))
	os.Stdout.Sync()

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	sig := <-signals
	// No graceful HTTP shutdown: a client long-polling WaitForUpdates would hold
	// it open; exiting closes every socket at once.
	log.Printf("vcsim: %s received, stopping", sig)
	return nil
}

func main() {
	log.SetFlags(log.LstdFlags)
	if err := run(parseFlags()); err != nil {
		fmt.Fprintf(os.Stderr, "vcsim: %v\n", err)
		os.Exit(1)
	}
}
