//! One test per default, clamp, cross-flag rule and error of the agent's flags.

use super::*;
use clap::Parser as _;

#[derive(clap::Parser, Debug)]
struct Cli {
    #[command(flatten)]
    flags: Flags,
}

fn try_flags(args: &[&str]) -> Result<Flags, clap::Error> {
    Cli::try_parse_from(std::iter::once("flock-agent").chain(args.iter().copied())).map(|c| c.flags)
}

fn flags(args: &[&str]) -> Flags {
    try_flags(args).unwrap()
}

/// Outside a cluster, as uid 4242.
fn env() -> Environment {
    Environment {
        in_cluster: false,
        euid: 4242,
        publish_from_scratch: false,
    }
}

/// The options for `args` after `--node-name n1`.
fn check(args: &[&str]) -> Result<Options, OptionsError> {
    let all: Vec<&str> = ["--node-name", "n1"].iter().chain(args).copied().collect();
    Options::check(&flags(&all), &env())
}

fn error(args: &[&str]) -> String {
    check(args).unwrap_err().to_string()
}

#[test]
fn every_default_is_the_documented_one() {
    let o = check(&[]).unwrap();
    let rt = &o.runtime;
    assert_eq!(rt.agent.node_name, "n1");
    assert_eq!(rt.state_dir, PathBuf::from("/var/lib/flock"));
    assert_eq!(rt.store_durability, crate::store::Durability::ProcessCrash);
    assert_eq!(rt.cni_socket, PathBuf::from("/run/flock/cni.sock"));
    assert_eq!(
        rt.xds_socket,
        Some(XdsSocket {
            path: PathBuf::from(DEFAULT_XDS_SOCKET),
            owner_uid: None,
            group: None
        })
    );
    assert_eq!(rt.xds_tls, None);
    assert_eq!(
        rt.xds_limits,
        XdsLimits {
            max_connections: 1024,
            max_streams_per_connection: 100,
            first_request_timeout: Duration::from_secs(10),
            max_open_streams: 4096,
            max_unix_connections: 1024,
            idle_timeout: Duration::from_secs(10),
            subscription_budget: flock_xds::server::SubscriptionBudget::default(),
        }
    );
    assert_eq!(rt.admin_address, "127.0.0.1:18090".parse().unwrap());
    assert_eq!(
        rt.admin_max_connections,
        crate::admin::server::DEFAULT_MAX_CONNECTIONS
    );
    assert_eq!(rt.registry, "memory");
    assert_eq!(rt.registry_ttl_secs, 10);
    assert!(rt.registry_tls.is_none() && rt.registry_auth.is_none());
    assert!(rt.registry_scope.is_none());
    assert_eq!(
        rt.registry_max_entries_per_node,
        flock_core::registry::DEFAULT_MAX_ENTRIES_PER_NODE
    );
    assert_eq!(
        rt.identity,
        IdentitySource::Builtin {
            trust_domain: "cluster.local".into(),
            svid_ttl: Duration::from_secs(3600),
            ca_dir: None
        }
    );
    assert_eq!(rt.kube, None);
    assert_eq!((rt.agent.zone.as_str(), rt.agent.region.as_str()), ("", ""));
    assert_eq!(rt.agent.liveness.interval_ms, 5000);
    assert_eq!(rt.agent.gc_interval, Duration::from_secs(60));
    assert_eq!(rt.agent.capture, NodeCapture::default());
    assert!(!rt.agent.publish_from_scratch);
    assert!(!o.dev && !o.xds_socket_given);
    assert_eq!(
        (o.envoy_cluster.as_str(), &o.envoy_admin),
        (
            "flock",
            &runtime::EnvoyAdmin::Socket(PathBuf::from(DEFAULT_ENVOY_ADMIN_SOCKET))
        )
    );
    assert!(!o.envoy_admin_given);
    assert_eq!(o.log_format, "text");
    assert!(o.keep_capabilities.is_empty());
    assert!(o.bind_time_capabilities.is_empty());
}

#[test]
fn the_pod_store_survives_the_agents_crash_by_default_and_a_power_loss_on_request() {
    use crate::store::Durability;
    let power = check(&["--store-sync", "power-loss"]).unwrap();
    assert_eq!(power.runtime.store_durability, Durability::PowerLoss);
    let crash = check(&["--store-sync", "crash"]).unwrap();
    assert_eq!(crash.runtime.store_durability, Durability::ProcessCrash);
    assert!(try_flags(&["--store-sync", "never"]).is_err());
}

#[test]
fn intervals_and_limits_below_their_floor_are_raised_to_it() {
    let o = check(&[
        "--probe-interval-ms",
        "0",
        "--gc-interval",
        "0",
        "--xds-max-connections",
        "0",
        "--xds-max-streams",
        "0",
        "--xds-max-open-streams",
        "0",
        "--xds-first-request-timeout",
        "0",
        "--xds-max-unix-connections",
        "0",
        "--xds-idle-timeout",
        "0",
    ])
    .unwrap();
    assert_eq!(o.runtime.agent.liveness.interval_ms, MIN_PROBE_INTERVAL_MS);
    assert_eq!(o.runtime.agent.gc_interval, Duration::from_secs(1));
    assert_eq!(
        o.runtime.xds_limits,
        XdsLimits {
            max_connections: 1,
            max_streams_per_connection: 1,
            first_request_timeout: Duration::from_secs(1),
            max_open_streams: 1,
            max_unix_connections: 1,
            idle_timeout: Duration::from_secs(1),
            subscription_budget: flock_xds::server::SubscriptionBudget::default(),
        }
    );
    // Above the floor a value is taken as given.
    let o = check(&["--probe-interval-ms", "101", "--gc-interval", "7"]).unwrap();
    assert_eq!(o.runtime.agent.liveness.interval_ms, 101);
    assert_eq!(o.runtime.agent.gc_interval, Duration::from_secs(7));
}

#[test]
fn a_node_name_is_required_unless_dev_and_always_validated() {
    let none = Options::check(&flags(&[]), &env()).unwrap_err().to_string();
    assert!(none.starts_with("no node name: set --node-name"), "{none}");
    let dev = Options::check(&flags(&["--dev"]), &env()).unwrap();
    assert_eq!(dev.runtime.agent.node_name, DEV_NODE_NAME);
    assert!(dev.dev);
    let named = Options::check(&flags(&["--dev", "--node-name", "n2"]), &env()).unwrap();
    assert_eq!(named.runtime.agent.node_name, "n2");
    let bad = Options::check(&flags(&["--node-name", "Node_1"]), &env())
        .unwrap_err()
        .to_string();
    assert!(bad.starts_with("node name \"Node_1\" contains"), "{bad}");
}

#[test]
fn listeners_stay_on_loopback_unless_allowed() {
    let e = error(&["--admin-address", "0.0.0.0:18090"]);
    assert!(
        e.starts_with("--admin-address 0.0.0.0:18090 is not a loopback"),
        "{e}"
    );
    let o = check(&["--admin-address", "0.0.0.0:18090", "--allow-non-loopback"]).unwrap();
    assert_eq!(o.runtime.admin_address, "0.0.0.0:18090".parse().unwrap());
    let tls = [
        "--xds-tls-cert",
        "/c",
        "--xds-tls-key",
        "/k",
        "--xds-tls-client-ca",
        "/ca",
    ];
    let mut wide = vec!["--xds-address", "10.0.0.1:18000"];
    wide.extend(tls);
    let e = error(&wide);
    assert!(
        e.starts_with("--xds-address 10.0.0.1:18000 is not a loopback"),
        "{e}"
    );
    wide.push("--allow-non-loopback");
    assert!(check(&wide).unwrap().runtime.xds_tls.is_some());
}

#[test]
fn xds_over_tcp_takes_all_four_flags_or_none() {
    let full = [
        "--xds-address",
        "127.0.0.1:18000",
        "--xds-tls-cert",
        "/c",
        "--xds-tls-key",
        "/k",
        "--xds-tls-client-ca",
        "/ca",
    ];
    assert_eq!(
        check(&full).unwrap().runtime.xds_tls,
        Some(XdsTls {
            address: "127.0.0.1:18000".parse().unwrap(),
            cert: "/c".into(),
            key: "/k".into(),
            client_ca: "/ca".into(),
        })
    );
    let plaintext = error(&full[..2]);
    assert!(
        plaintext.starts_with("--xds-address 127.0.0.1:18000: xDS over TCP needs mTLS"),
        "{plaintext}"
    );
    let no_key = error(&[&full[..4], &full[6..]].concat());
    assert!(no_key.contains("needs mTLS"), "{no_key}");
    let no_address = error(&full[2..]);
    assert_eq!(
        no_address,
        "--xds-tls-cert/--xds-tls-key/--xds-tls-client-ca need --xds-address (and all three)"
    );
}

#[test]
fn the_registry_tls_files_need_the_ca_and_are_read_here() {
    let e = error(&["--registry-cert", "/c", "--registry-key", "/k"]);
    assert_eq!(
        e,
        "--registry-cert/--registry-key need --registry-ca (the CA of etcd's server certificate)"
    );
    let e = error(&["--registry-ca", "/nonexistent/ca.pem"]);
    assert!(e.starts_with("--registry-ca /nonexistent/ca.pem: "), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").unwrap();
    let ca = ca.to_str().unwrap();
    let o = check(&["--registry-ca", ca]).unwrap();
    let tls = o.runtime.registry_tls.unwrap();
    assert_eq!(tls.ca_pem, "-----BEGIN CERTIFICATE-----\n");
    assert!(tls.cert_pem.is_none());
    let e = error(&["--registry-ca", ca, "--registry-cert", ca]);
    assert!(
        e.starts_with("--registry-cert and --registry-key go together"),
        "{e}"
    );
}

#[test]
fn the_registry_user_and_its_password_file_go_together() {
    let e = error(&["--registry-user", "u"]);
    assert_eq!(
        e,
        "--registry-user and --registry-password-file go together"
    );
    let e = error(&["--registry-password-file", "/p"]);
    assert_eq!(
        e,
        "--registry-user and --registry-password-file go together"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("password");
    std::fs::write(&file, "secret\n").unwrap();
    let file = file.to_str().unwrap();
    let auth = check(&["--registry-user", "u", "--registry-password-file", file])
        .unwrap()
        .runtime
        .registry_auth
        .unwrap();
    assert_eq!(
        (auth.user.as_str(), auth.password.as_str()),
        ("u", "secret")
    );
}

/// `--registry-scope` is read and parsed at start (a bad line stops the agent, naming
/// it), only with an etcd registry; `--registry-max-entries-per-node` is at least 1.
#[test]
fn the_registry_scope_is_parsed_at_start_and_only_for_etcd() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("scope");
    std::fs::write(&file, "n1: shop/web\nn2: shop/cart db/pg\n").unwrap();
    let file = file.to_str().unwrap();
    let e = error(&["--registry-scope", file]);
    assert!(
        e.starts_with("--registry-scope applies to etcd registries"),
        "{e}"
    );
    let rt = check(&[
        "--registry",
        "etcd://127.0.0.1:2379",
        "--registry-scope",
        file,
        "--registry-max-entries-per-node",
        "0",
    ])
    .unwrap()
    .runtime;
    let scope = rt.registry_scope.unwrap();
    assert_eq!(scope.nodes.len(), 2);
    assert!(scope.nodes["n2"].contains(&("db".to_string(), "pg".to_string())));
    assert_eq!(rt.registry_max_entries_per_node, 1);
    let bad = dir.path().join("bad");
    std::fs::write(&bad, "n1 shop/web\n").unwrap();
    let e = error(&[
        "--registry",
        "etcd://127.0.0.1:2379",
        "--registry-scope",
        bad.to_str().unwrap(),
    ]);
    assert!(e.contains("line 1"), "{e}");
    let e = error(&[
        "--registry",
        "etcd://127.0.0.1:2379",
        "--registry-scope",
        "/nonexistent/scope",
    ]);
    assert!(
        e.starts_with("--registry-scope /nonexistent/scope: "),
        "{e}"
    );
}

#[test]
fn identity_sources_parse_and_only_the_builtin_ca_takes_a_ca_dir() {
    let o = check(&["--identity", "spire:/run/spire/admin.sock"]).unwrap();
    assert_eq!(
        o.runtime.identity,
        IdentitySource::Spire {
            socket: "/run/spire/admin.sock".into()
        }
    );
    assert_eq!(
        check(&["--identity", "none"]).unwrap().runtime.identity,
        IdentitySource::None
    );
    let o = check(&[
        "--ca-dir",
        "/etc/cacerts",
        "--trust-domain",
        "example.org",
        "--svid-ttl",
        "60",
    ])
    .unwrap();
    assert_eq!(
        o.runtime.identity,
        IdentitySource::Builtin {
            trust_domain: "example.org".into(),
            svid_ttl: Duration::from_secs(60),
            ca_dir: Some("/etc/cacerts".into())
        }
    );
    let e = error(&["--identity", "none", "--ca-dir", "/etc/cacerts"]);
    assert_eq!(
        e,
        "--ca-dir /etc/cacerts: only the built-in CA (--identity builtin) takes an issuer from a directory"
    );
    let e = error(&["--identity", "vault"]);
    assert_eq!(
        e,
        "--identity \"vault\": expected builtin, flock-ca:https://HOST:PORT, none or spire:PATH"
    );
    let e = error(&["--identity", "spire:"]);
    assert!(
        e.starts_with("--identity spire:: expected spire:PATH"),
        "{e}"
    );
}

#[test]
fn kube_mode_is_chosen_by_a_flag_and_a_cluster_without_one_is_refused() {
    let checked = |args: &[&str], in_cluster: bool| {
        let all: Vec<&str> = ["--node-name", "n1"].iter().chain(args).copied().collect();
        let env = Environment {
            in_cluster,
            ..env()
        };
        Options::check(&flags(&all), &env).map(|o| o.runtime.kube)
    };
    let kube = |args: &[&str], in_cluster: bool| checked(args, in_cluster).unwrap();
    assert_eq!(kube(&[], false), None);
    let on = kube(&["--kube"], false).unwrap();
    assert_eq!(on.kubeconfig, None);
    assert_eq!(on.pod_wait, Duration::from_secs(2));
    let with_config = kube(&["--kubeconfig", "/k"], false).unwrap();
    assert_eq!(with_config.kubeconfig, Some(PathBuf::from("/k")));
    // The environment alone never picks the trust model.
    let refused = checked(&[], true).unwrap_err().0;
    assert!(
        refused.starts_with("running in a Kubernetes cluster") && refused.contains("--kube"),
        "{refused}"
    );
    assert!(kube(&["--kube"], true).is_some());
    assert_eq!(kube(&["--no-kube"], true), None);
    assert_eq!(kube(&["--no-kube"], false), None);
    assert!(try_flags(&["--kube", "--no-kube"]).is_err());
    assert!(try_flags(&["--kubeconfig", "/k", "--no-kube"]).is_err());
    let wait = kube(&["--kube", "--kube-pod-wait", "500ms"], false).unwrap();
    assert_eq!(wait.pod_wait, Duration::from_millis(500));
}

#[test]
fn the_startup_taint_is_removed_by_default_in_kube_mode_unless_turned_off() {
    let kube = |args: &[&str]| check(args).unwrap().runtime.kube.unwrap();
    let on = kube(&["--kube"]);
    assert!(on.remove_startup_taint);
    assert_eq!(on.cni_ready_file, None);
    assert!(kube(&["--kube", "--remove-startup-taint"]).remove_startup_taint);
    assert!(!kube(&["--kube", "--remove-startup-taint=false"]).remove_startup_taint);
    let file = kube(&["--kube", "--cni-ready-file", "/r"]);
    assert_eq!(file.cni_ready_file, Some(PathBuf::from("/r")));
}

#[test]
fn endpoint_label_keys_are_off_by_default_and_checked() {
    let kube = |args: &[&str]| check(args).unwrap().runtime.kube.unwrap();
    // None by default: an older agent drops an entry with labels.
    assert!(kube(&["--kube"]).endpoint_labels.is_empty());
    assert_eq!(
        kube(&["--kube", "--endpoint-labels", "track, version"]).endpoint_labels,
        ["track", "version"]
    );
    assert!(
        error(&["--kube", "--endpoint-labels", "a b"]).contains("--endpoint-labels: label key"),
        "{}",
        error(&["--kube", "--endpoint-labels", "a b"])
    );
    assert!(error(&["--kube", "--endpoint-labels", "a,b,c,d,e,f,g,h,i"]).contains("more than 8"),);
}

#[test]
fn durations_take_ms_s_or_plain_seconds() {
    assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
    assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
    for bad in ["", "s", "-1s", "2m", "1.5s", "99999999999999999999s"] {
        assert!(parse_duration(bad).is_err(), "{bad:?}");
    }
    let e = try_flags(&["--kube-pod-wait", "2m"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"2m\" is not a duration"), "{e}");
}

#[test]
fn capture_settings_are_parsed_per_flag_and_keep_net_admin() {
    let o = check(&[
        "--capture",
        "strict",
        "--capture-probe-source",
        "10.0.0.1,10.1.0.0/16",
        "--capture-exclude-outbound-ports",
        "5432",
        "--capture-exclude-outbound-ports",
        "6379",
        "--capture-exclude-outbound-cidrs",
        "169.254.169.254/32",
        "--capture-exclude-inbound-ports",
        "9090",
        "--capture-allow-proxyless-ports",
        "50051",
    ])
    .unwrap();
    let c = &o.runtime.agent.capture;
    assert_eq!(c.setting, Setting::Strict);
    assert_eq!(c.probe_sources.len(), 2);
    assert_eq!(c.exclude_outbound_ports, vec![5432, 6379]);
    assert_eq!(c.exclude_outbound_cidrs.len(), 1);
    assert_eq!(c.exclude_inbound_ports, vec![9090]);
    assert_eq!(c.allow_proxyless_ports, vec![50051]);
    assert_eq!(o.keep_capabilities, vec![Capability::CAP_NET_ADMIN]);
    assert!(try_flags(&["--capture", "sometimes"]).is_err());
    for (flag, value, want) in [
        (
            "--capture-probe-source",
            "nope",
            "--capture-probe-source: \"nope\" is not an IP",
        ),
        (
            "--capture-exclude-outbound-ports",
            "0",
            "--capture-exclude-outbound-ports: \"0\" is not a port",
        ),
        (
            "--capture-exclude-outbound-cidrs",
            "x/8",
            "--capture-exclude-outbound-cidrs: \"x/8\" is not an IP",
        ),
        (
            "--capture-exclude-inbound-ports",
            "70000",
            "--capture-exclude-inbound-ports: \"70000\" is not a port",
        ),
    ] {
        let e = error(&[flag, value]);
        assert!(e.starts_with(want), "{flag} {value}: {e}");
    }
}

#[test]
fn kept_capabilities_parse_with_or_without_the_prefix() {
    let o = check(&[
        "--keep-capability",
        "CAP_SYS_PTRACE",
        "--keep-capability",
        "net_raw",
    ])
    .unwrap();
    assert_eq!(
        o.keep_capabilities,
        vec![Capability::CAP_SYS_PTRACE, Capability::CAP_NET_RAW]
    );
    let e = try_flags(&["--keep-capability", "fly"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"fly\" is not a Linux capability"), "{e}");
}

#[test]
fn binding_needs_chown_for_a_handed_over_socket_and_net_bind_below_1024() {
    let caps = |args: &[&str]| check(args).unwrap().bind_time_capabilities;
    assert_eq!(caps(&["--envoy-uid", "101"]), vec![Capability::CAP_CHOWN]);
    assert_eq!(
        caps(&["--xds-socket-group", "1337"]),
        vec![Capability::CAP_CHOWN]
    );
    assert_eq!(
        caps(&["--admin-address", "127.0.0.1:80"]),
        vec![Capability::CAP_NET_BIND_SERVICE]
    );
    // Port 0 is an ephemeral port, not a privileged one.
    assert!(caps(&["--admin-address", "127.0.0.1:0"]).is_empty());
    let xds = caps(&[
        "--xds-address",
        "127.0.0.1:443",
        "--xds-tls-cert",
        "/c",
        "--xds-tls-key",
        "/k",
        "--xds-tls-client-ca",
        "/ca",
    ]);
    assert_eq!(xds, vec![Capability::CAP_NET_BIND_SERVICE]);
}

#[test]
fn the_xds_socket_admits_the_agent_envoy_and_the_allow_lists() {
    let o = check(&[
        "--envoy-uid",
        "101",
        "--xds-allow-uid",
        "7",
        "--xds-allow-gid",
        "1337",
        "--xds-socket-group",
        "1337",
        "--xds-envoy-spiffe-id",
        "spiffe://cluster.local/ns/flock/sa/envoy",
    ])
    .unwrap();
    let access = &o.runtime.xds_access;
    assert_eq!(access.allow_uids, [7, 101, 4242].into());
    assert_eq!(access.allow_gids, [1337].into());
    assert_eq!(access.trust_domain, "cluster.local");
    assert_eq!(
        access.envoy_spiffe_ids,
        ["spiffe://cluster.local/ns/flock/sa/envoy".to_string()].into()
    );
    let socket = o.runtime.xds_socket.unwrap();
    assert_eq!((socket.owner_uid, socket.group), (Some(101), Some(1337)));
}

#[test]
fn the_environment_sets_the_from_scratch_baseline() {
    let env = Environment {
        publish_from_scratch: true,
        ..env()
    };
    let o = Options::check(&flags(&["--node-name", "n1"]), &env).unwrap();
    assert!(o.runtime.agent.publish_from_scratch);
}

#[test]
fn try_from_applies_the_same_rules_with_this_process_environment() {
    let o = Options::try_from(flags(&[
        "--node-name",
        "n1",
        "--zone",
        "z",
        "--region",
        "r",
    ]))
    .unwrap();
    assert_eq!(
        (
            o.runtime.agent.zone.as_str(),
            o.runtime.agent.region.as_str()
        ),
        ("z", "r")
    );
    let euid = nix::unistd::geteuid().as_raw();
    assert!(o.runtime.xds_access.allow_uids.contains(&euid));
    assert!(Options::try_from(flags(&[])).is_err());
}

#[test]
fn dev_puts_state_and_sockets_in_its_directory_unless_a_socket_is_given() {
    let dir = Path::new("/tmp/flock-dev-x");
    let mut o = Options::check(&flags(&["--dev"]), &env()).unwrap();
    let (path, doc) = o.dev_layout(dir);
    assert_eq!(path, dir.join("envoy-bootstrap.json"));
    assert_eq!(o.runtime.state_dir, dir.join("pods"));
    assert_eq!(o.runtime.cni_socket, dir.join("cni.sock"));
    let xds = dir.join("run/xds.sock");
    assert_eq!(o.runtime.xds_socket.as_ref().unwrap().path, xds);
    let dev_admin = runtime::EnvoyAdmin::Socket(dir.join("envoy-admin.sock"));
    assert_eq!(
        doc,
        runtime::envoy_bootstrap(DEV_NODE_NAME, "flock", &xds, &dev_admin)
    );
    let mut o = Options::check(&flags(&["--dev", "--xds-socket", "/s.sock"]), &env()).unwrap();
    let (_, doc) = o.dev_layout(dir);
    assert_eq!(o.runtime.xds_socket.unwrap().path, PathBuf::from("/s.sock"));
    assert_eq!(
        doc,
        runtime::envoy_bootstrap(DEV_NODE_NAME, "flock", Path::new("/s.sock"), &dev_admin)
    );
    // An admin given explicitly wins over the directory, the TCP port over the socket.
    let mut o = Options::check(
        &flags(&["--dev", "--envoy-admin-socket", "/e/admin.sock"]),
        &env(),
    )
    .unwrap();
    assert_eq!(
        o.dev_layout(dir).1["admin"]["address"]["pipe"]["path"],
        "/e/admin.sock"
    );
    let mut o = Options::check(
        &flags(&[
            "--dev",
            "--envoy-admin-socket",
            "/e",
            "--envoy-admin-port",
            "9",
        ]),
        &env(),
    )
    .unwrap();
    assert_eq!(
        o.dev_layout(dir).1["admin"]["address"]["socket_address"]["port_value"],
        9
    );
}

#[test]
fn the_bootstrap_needs_a_node_name_and_a_known_socket() {
    let doc = envoy_bootstrap(&flags(&[
        "--node-name",
        "n1",
        "--envoy-cluster",
        "c",
        "--envoy-admin-port",
        "9901",
    ]))
    .unwrap();
    assert_eq!(
        doc,
        runtime::envoy_bootstrap(
            "n1",
            "c",
            Path::new(DEFAULT_XDS_SOCKET),
            &runtime::EnvoyAdmin::LoopbackPort(9901)
        )
    );
    // The agent would refuse these flags; the bootstrap only needs the node and socket.
    assert!(envoy_bootstrap(&flags(&["--node-name", "n1", "--registry-user", "u"])).is_ok());
    let e = envoy_bootstrap(&flags(&["--dev"])).unwrap_err().to_string();
    assert!(
        e.starts_with("with --dev the xDS socket is in a fresh temporary"),
        "{e}"
    );
    let doc = envoy_bootstrap(&flags(&["--dev", "--xds-socket", "/s"])).unwrap();
    assert_eq!(
        doc,
        runtime::envoy_bootstrap(
            DEV_NODE_NAME,
            "flock",
            Path::new("/s"),
            &runtime::EnvoyAdmin::Socket(PathBuf::from(DEFAULT_ENVOY_ADMIN_SOCKET))
        )
    );
    // The default admin: a 0600 unix socket, no TCP port.
    let admin = &doc["admin"]["address"];
    assert_eq!(admin["pipe"]["path"], DEFAULT_ENVOY_ADMIN_SOCKET);
    assert_eq!(admin["pipe"]["mode"], 0o600);
    assert!(admin.get("socket_address").is_none());
    let e = envoy_bootstrap(&flags(&[])).unwrap_err().to_string();
    assert!(e.starts_with("no node name"), "{e}");
}

#[test]
fn the_bootstraps_limits_are_checked_before_envoy_would_refuse_them() {
    let e = envoy_bootstrap(&flags(&["--node-name", "n1", "--envoy-memory-limit", "99"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("--envoy-memory-limit 99: less than 64 MiB"),
        "{e}"
    );
    let e = envoy_bootstrap(&flags(&[
        "--node-name",
        "n1",
        "--envoy-max-connections",
        "0",
    ]))
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("--envoy-max-connections 0"), "{e}");
    // 0 is "no limit", as an unset downward-API value would be.
    let doc = envoy_bootstrap(&flags(&["--node-name", "n1", "--envoy-memory-limit", "0"])).unwrap();
    assert_eq!(
        doc["overload_manager"]["resource_monitors"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let doc = envoy_bootstrap(&flags(&[
        "--node-name",
        "n1",
        "--envoy-memory-limit",
        "1073741824",
    ]))
    .unwrap();
    assert_eq!(
        doc["overload_manager"]["resource_monitors"][1]["typed_config"]["max_heap_size_bytes"],
        1073741824u64 / 100 * 90
    );
}

#[test]
fn the_node_scoped_signer_needs_a_node_credential_and_only_it_takes_one() {
    let o = check(&[
        "--identity",
        "flock-ca:https://flock-ca.flock-system.svc:8443",
        "--node-credential",
        "/var/run/flock/node",
        "--ca-server-name",
        "signer.example",
    ])
    .unwrap();
    assert_eq!(
        o.runtime.identity,
        IdentitySource::FlockCa {
            trust_domain: "cluster.local".into(),
            url: "https://flock-ca.flock-system.svc:8443".into(),
            credential_dir: "/var/run/flock/node".into(),
            server_name: "signer.example".into(),
        }
    );
    let e = error(&["--identity", "flock-ca:https://ca:8443"]);
    assert!(e.contains("needs --node-credential DIR"), "{e}");
    let e = error(&["--node-credential", "/n"]);
    assert!(
        e.contains("only --identity flock-ca:... takes a node credential"),
        "{e}"
    );
    for bad in ["flock-ca:", "flock-ca:http://ca:8443", "flock-ca:https://"] {
        let e = error(&["--identity", bad, "--node-credential", "/n"]);
        assert!(
            e.contains("expected flock-ca:https://HOST:PORT"),
            "{bad}: {e}"
        );
    }
}

#[test]
fn telemetry_flags_choose_where_envoy_samples_and_validate_their_targets() {
    // Off by default: Envoy sends nothing.
    let o = check(&[]).unwrap();
    assert_eq!(o.runtime.agent.access_log, None);
    assert_eq!(o.runtime.agent.tracing, None);
    assert!(!o.runtime.workload_metrics);
    // An access log alone: Envoy samples.
    let o = check(&[
        "--access-log",
        "/var/log/flock/access.log",
        "--access-log-sample-percent",
        "10",
    ])
    .unwrap();
    assert_eq!(
        o.runtime.agent.access_log.as_ref().unwrap().sample_percent,
        10
    );
    assert_eq!(o.runtime.access_log_line_percent, 100);
    // With the metrics, Envoy sends every entry and the agent samples the lines.
    let o = check(&[
        "--access-log",
        "-",
        "--access-log-sample-percent",
        "10",
        "--workload-metrics",
    ])
    .unwrap();
    assert_eq!(
        o.runtime.agent.access_log.as_ref().unwrap().sample_percent,
        100
    );
    assert_eq!(o.runtime.access_log_line_percent, 10);
    assert_eq!(
        o.runtime.access_log,
        Some(crate::access_log::Destination::Stdout)
    );
    // The metrics alone: entries, no lines.
    let o = check(&["--workload-metrics"]).unwrap();
    assert!(o.runtime.agent.access_log.is_some());
    assert_eq!(o.runtime.access_log, None);
    for bad in ["access.log", "./access.log", "/var/log/"] {
        let e = error(&["--access-log", bad]);
        assert!(e.contains("an absolute file path, or -"), "{bad}: {e}");
    }
    // The trace collector: a name or an address, and a port.
    for (spec, host, port) in [
        (
            "otel-collector.observability:4317",
            "otel-collector.observability",
            4317,
        ),
        ("10.0.0.5:4317", "10.0.0.5", 4317),
        ("[fd00::5]:4317", "fd00::5", 4317),
    ] {
        let o = check(&["--trace-collector", spec]).unwrap();
        let t = o.runtime.agent.tracing.unwrap();
        assert_eq!((t.collector_host.as_str(), t.collector_port), (host, port));
        assert_eq!(t.sample_percent, 1);
    }
    for bad in [
        "collector",
        "collector:0",
        ":4317",
        "a b:4317",
        "host:99999",
        "x_y:1",
    ] {
        let e = error(&["--trace-collector", bad]);
        assert!(e.contains("expected HOST:PORT"), "{bad}: {e}");
    }
    assert!(try_flags(&["--node-name", "n1", "--trace-sample-percent", "101"]).is_err());
    assert!(try_flags(&["--node-name", "n1", "--access-log-sample-percent", "0"]).is_err());
}
