//! A pod's policy route over rtnetlink: the rule and the table's one route, written
//! from the thread that entered the pod's netns, with no `ip` process.
//!
//! The messages are the ones `ip [-6] route replace local default dev lo table T` and
//! `ip [-6] rule add fwmark M lookup T pref T` send (iproute2's encoding: a table
//! above 255 goes in the `RTA_TABLE`/`FRA_TABLE` attribute, the header's is
//! `RT_TABLE_UNSPEC`), so what the kernel holds, and what `ip -j` lists for CHECK, is
//! the same either way.

use flock_core::capture::PolicyRoute;
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkHeader,
    NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::route::{
    RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use std::io;

/// The loopback interface's index: the kernel creates `lo` first in every netns
/// (`LOOPBACK_IFINDEX`).
const LOOPBACK_IFINDEX: u32 = 1;

/// Most bytes of replies read for one request (a rule dump at one priority is a few
/// hundred bytes; a netns with more is refused, as `ip -j` output over its bound is).
const MAX_REPLY_BYTES: usize = 1 << 20;

/// A netlink route socket of the calling thread's netns.
pub(crate) struct Rtnl {
    socket: Socket,
    seq: u32,
}

impl Rtnl {
    /// A socket in the netns the calling thread is in now (a socket stays in the
    /// netns it was created in).
    pub(crate) fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Rtnl { socket, seq: 0 })
    }

    /// Sends `msg` with `flags` and reads to its end: the ACK (a request) or `Done`
    /// (a dump). The messages the kernel answered with, or the kernel's error.
    fn request(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> io::Result<Vec<RouteNetlinkMessage>> {
        self.seq = self.seq.wrapping_add(1);
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags | if dump { 0 } else { NLM_F_ACK };
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        packet.finalize();
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        let mut out = Vec::new();
        let mut read = 0;
        loop {
            let (bytes, _) = self.socket.recv_from_full()?;
            read += bytes.len();
            if read > MAX_REPLY_BYTES {
                return Err(io::Error::other(format!(
                    "more than {MAX_REPLY_BYTES} bytes of replies"
                )));
            }
            let mut at = 0;
            while at < bytes.len() {
                let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&bytes[at..])
                    .map_err(|e| io::Error::other(format!("a reply does not decode: {e}")))?;
                let len = reply.header.length as usize;
                if len == 0 {
                    return Err(io::Error::other("a reply of length 0"));
                }
                at += len;
                if reply.header.sequence_number != self.seq {
                    continue; // not ours (a late reply to an earlier request)
                }
                match reply.payload {
                    NetlinkPayload::InnerMessage(m) => out.push(m),
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(out),
                            Some(_) => Err(e.to_io()),
                        };
                    }
                    NetlinkPayload::Done(_) => return Ok(out),
                    _ => {}
                }
            }
        }
    }

    /// The rules at `route`'s priority in its family.
    pub(crate) fn rules(&mut self, route: PolicyRoute) -> io::Result<Vec<RuleMessage>> {
        let mut query = RuleMessage::default();
        query.header.family = family(route);
        let all = self.request(RouteNetlinkMessage::GetRule(query), NLM_F_DUMP)?;
        Ok(all
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewRule(r)
                    if r.attributes.contains(&RuleAttribute::Priority(route.table)) =>
                {
                    Some(r)
                }
                _ => None,
            })
            .collect())
    }

    /// Makes the netns hold `route`, as `apply_route`'s `ip -batch` did: the table's
    /// local default route (replace converges), then, unless exactly the rule is
    /// there, every rule at its priority removed and the rule added.
    pub(crate) fn apply(&mut self, route: PolicyRoute) -> io::Result<()> {
        self.request(
            RouteNetlinkMessage::NewRoute(local_default(route)),
            NLM_F_CREATE | NLM_F_REPLACE,
        )?;
        let rules = self.rules(route)?;
        if rules.len() == 1 && is_the_rule(&rules[0], route) {
            return Ok(());
        }
        for stray in rules {
            self.request(RouteNetlinkMessage::DelRule(stray), 0)?;
        }
        self.request(
            RouteNetlinkMessage::NewRule(the_rule(route)),
            NLM_F_CREATE | NLM_F_EXCL,
        )?;
        Ok(())
    }
}

fn family(route: PolicyRoute) -> AddressFamily {
    if route.ipv6 {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    }
}

/// iproute2's header table: the id when it fits a byte, else `RT_TABLE_UNSPEC` (the
/// attribute carries it).
fn header_table(table: u32) -> u8 {
    u8::try_from(table).unwrap_or(RouteHeader::RT_TABLE_UNSPEC)
}

/// `local default dev lo table T`.
fn local_default(route: PolicyRoute) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = family(route);
    m.header.table = header_table(route.table);
    m.header.protocol = RouteProtocol::Boot;
    m.header.scope = RouteScope::Host;
    m.header.kind = RouteType::Local;
    m.attributes = vec![
        RouteAttribute::Table(route.table),
        RouteAttribute::Oif(LOOPBACK_IFINDEX),
    ];
    m
}

/// `fwmark M lookup T pref T`.
fn the_rule(route: PolicyRoute) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = family(route);
    m.header.table = header_table(route.table);
    m.header.action = RuleAction::ToTable;
    m.attributes = vec![
        RuleAttribute::Priority(route.table),
        RuleAttribute::FwMark(route.mark),
        RuleAttribute::Table(route.table),
    ];
    m
}

/// Whether a listed rule is `route`'s: its mark, no mask narrower than all bits, its
/// table, a lookup.
fn is_the_rule(rule: &RuleMessage, route: PolicyRoute) -> bool {
    let table = rule
        .attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(rule.header.table));
    let mask_ok = rule.attributes.iter().all(|a| match a {
        RuleAttribute::FwMask(m) => *m == u32::MAX,
        _ => true,
    });
    rule.header.action == RuleAction::ToTable
        && table == route.table
        && mask_ok
        && rule.attributes.contains(&RuleAttribute::FwMark(route.mark))
}
