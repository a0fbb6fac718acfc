//! `--user UID[:GID]`: the supervisor, and so every Envoy epoch it starts, as a uid of
//! its own instead of root.
//!
//! Why: the agent's CNI socket, its pod store and state directory are uid 0's (0600
//! in 0700 directories, and the CNI server checks the peer's uid with `SO_PEERCRED`).
//! An Envoy that is uid 0 too passes all of that: a compromised Envoy could send a CNI
//! DEL (removing a pod's capture) or an ADD, or rewrite the store. As its own uid it
//! reaches only what the agent hands it: the xDS socket (`flock-agent --envoy-uid`).
//!
//! What Envoy still needs, kept as ambient capabilities so they survive the `exec`
//! of a binary without file capabilities (and the parent-death shim's exec before it):
//!
//! * `CAP_SYS_ADMIN`: Envoy opens each pod's listeners and connects to its app inside
//!   the pod's network namespace (`network_namespace_filepath`: `setns`).
//! * `CAP_NET_ADMIN`: with transparent capture Envoy marks its upstream sockets
//!   (`SO_MARK`) so the pod's rules let them pass.
//! * `CAP_NET_BIND_SERVICE`: a listener on a port below 1024.
//!
//! Each is kept only if the supervisor had it; every other capability is dropped from
//! every set, the bounding set included (with `CAP_SETPCAP`), so no `exec` regains one.
//! Switching uids needs `CAP_SETUID` and `CAP_SETGID`, which are dropped by the switch.

use caps::{CapSet, Capability, CapsHashSet};
use nix::unistd::{Gid, Uid, setgroups, setresgid, setresuid};

/// The capabilities Envoy keeps under `--user` (see the module docs).
pub const ENVOY_CAPS: &[Capability] = &[
    Capability::CAP_SYS_ADMIN,
    Capability::CAP_NET_ADMIN,
    Capability::CAP_NET_BIND_SERVICE,
];

/// A uid and gid to run as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct User {
    /// The uid (never 0).
    pub uid: u32,
    /// The gid (the uid's number unless given).
    pub gid: u32,
}

/// Parses `UID[:GID]` (numbers: the supervisor runs in images without a passwd
/// entry for Envoy's uid).
pub fn parse(s: &str) -> Result<User, String> {
    let (uid, gid) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (s, None),
    };
    let number = |what: &str, v: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("--user {s:?}: the {what} {v:?} is not a number (UID[:GID])"))
    };
    let uid = number("uid", uid)?;
    let gid = match gid {
        Some(g) => number("gid", g)?,
        None => uid,
    };
    if uid == 0 || gid == 0 {
        return Err(format!(
            "--user {s:?}: Envoy's uid and gid must not be 0, which is the agent's: the \
             point of --user is that Envoy is not root"
        ));
    }
    Ok(User { uid, gid })
}

/// Switches this process (single-threaded: call it before any thread starts) to
/// `user`, keeping [`ENVOY_CAPS`] (those it has) as ambient capabilities. Returns the
/// capabilities kept.
pub fn become_user(user: User) -> Result<CapsHashSet, String> {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        format!(
            "--user {}:{}: {what}: {e} (the supervisor must start as root with \
             CAP_SETUID, CAP_SETGID and CAP_SETPCAP to switch to Envoy's uid)",
            user.uid, user.gid
        )
    };
    if !Uid::effective().is_root() {
        return Err(fail(
            "not started as root",
            &format!("euid is {}", Uid::effective()),
        ));
    }
    let permitted = caps::read(None, CapSet::Permitted).map_err(|e| fail("reading caps", &e))?;
    let keep: CapsHashSet = ENVOY_CAPS
        .iter()
        .copied()
        .filter(|c| permitted.contains(c))
        .collect();
    // The bounding set first, while CAP_SETPCAP is still effective.
    for cap in caps::read(None, CapSet::Bounding).map_err(|e| fail("reading caps", &e))? {
        if !keep.contains(&cap) {
            caps::drop(None, CapSet::Bounding, cap)
                .map_err(|e| fail("dropping from the bounding set", &e))?;
        }
    }
    // Keep the permitted set across setuid; the effective set is cleared by it.
    caps::securebits::set_keepcaps(true).map_err(|e| fail("PR_SET_KEEPCAPS", &e))?;
    setgroups(&[]).map_err(|e| fail("setgroups", &e))?;
    let gid = Gid::from_raw(user.gid);
    setresgid(gid, gid, gid).map_err(|e| fail("setresgid", &e))?;
    let uid = Uid::from_raw(user.uid);
    setresuid(uid, uid, uid).map_err(|e| fail("setresuid", &e))?;
    caps::securebits::set_keepcaps(false).map_err(|e| fail("PR_SET_KEEPCAPS", &e))?;
    for set in [CapSet::Permitted, CapSet::Effective, CapSet::Inheritable] {
        caps::set(None, set, &keep).map_err(|e| fail("setting caps", &e))?;
    }
    // Ambient: what a non-root process keeps across exec of a binary without file
    // capabilities (Envoy, and the shim that execs it).
    for cap in &keep {
        caps::raise(None, CapSet::Ambient, *cap).map_err(|e| fail("raising ambient caps", &e))?;
    }
    Ok(keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_and_group_are_numbers_and_never_root() {
        assert_eq!(
            parse("1337"),
            Ok(User {
                uid: 1337,
                gid: 1337
            })
        );
        assert_eq!(parse("1337:7"), Ok(User { uid: 1337, gid: 7 }));
        assert!(parse("0").unwrap_err().contains("must not be 0"));
        assert!(parse("1337:0").unwrap_err().contains("must not be 0"));
        assert!(parse("envoy").unwrap_err().contains("is not a number"));
        assert!(parse("1:x").unwrap_err().contains("gid \"x\""));
    }
}
