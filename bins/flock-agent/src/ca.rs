//! `flock-agent ca init|issue`: a shared root CA and per-node issuers in the `--ca-dir`
//! layout. Files are created 0600 in a 0700 directory, never through a symlink, and
//! never over an existing file without `--force`; keys are never printed.

use anyhow::{Context as _, bail};
use flock_bird::identity::ca_dir::{
    self, CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE, ROOT_KEY_FILE,
};
use flock_bird::identity::{CLOCK_SKEW, SecretPem};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `flock-agent ca`: make the shared trust root of the built-in CA.
#[derive(clap::Subcommand, Debug)]
pub enum CaCommand {
    /// Create a root CA: DIR/root-cert.pem and DIR/root-key.pem (DIR created 0700, files
    /// 0600). Keep the root key offline; `ca issue` signs each node's issuer with it.
    Init {
        /// The directory to write (created if missing; an existing one must be the
        /// caller's, not a symlink, and not group- or other-accessible).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// The trust domain named in the root's subject.
        #[arg(long, default_value = "cluster.local", value_name = "DOMAIN")]
        trust_domain: String,
        /// Validity of the root, days.
        #[arg(long, default_value_t = 3650, value_name = "N")]
        days: u32,
        /// Replace files that exist (atomically, by rename).
        #[arg(long)]
        force: bool,
    },
    /// Create a node issuer signed by the root in --root, in the `--ca-dir` layout:
    /// ca-cert.pem, ca-key.pem, cert-chain.pem (issuer then root), root-cert.pem. The
    /// result is checked the way `flock-agent --ca-dir` checks it.
    Issue {
        /// The root's directory (`ca init --out`).
        #[arg(long, value_name = "DIR")]
        root: PathBuf,
        /// The directory to write (the node's --ca-dir, or the Secret's contents).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Named in the issuer's subject (e.g. the node name).
        #[arg(long, default_value = "node", value_name = "NODE")]
        name: String,
        /// Validity of the issuer, days (never beyond the root's).
        #[arg(long, default_value_t = 365, value_name = "N")]
        days: u32,
        /// Replace files that exist (atomically, by rename).
        #[arg(long)]
        force: bool,
    },
}

fn days(n: u32) -> anyhow::Result<Duration> {
    if n == 0 {
        bail!("--days must be at least 1");
    }
    Ok(Duration::from_secs(u64::from(n) * 24 * 3600))
}

/// Runs a `ca` subcommand; prints what it wrote (never a key).
pub fn run(cmd: &CaCommand) -> anyhow::Result<()> {
    let now = flock_clock::unix_now();
    match cmd {
        CaCommand::Init {
            out,
            trust_domain,
            days: n,
            force,
        } => {
            let (cert, key) = ca_dir::generate_root(trust_domain, now, CLOCK_SKEW, days(*n)?)
                .map_err(|e| anyhow::anyhow!(e))?;
            write_files(
                out,
                &[
                    (ROOT_CERT_FILE, Content::Public(&cert)),
                    (ROOT_KEY_FILE, Content::Secret(&key)),
                ],
                *force,
            )?;
            println!(
                "root CA for trust domain {trust_domain} (valid {n} days) written to {}: {ROOT_CERT_FILE}, {ROOT_KEY_FILE} (keep the key offline)",
                out.display()
            );
        }
        CaCommand::Issue {
            root,
            out,
            name,
            days: n,
            force,
        } => {
            let (cert, key, roots) =
                ca_dir::generate_issuer(root, name, now, CLOCK_SKEW, days(*n)?)
                    .map_err(|e| anyhow::anyhow!(e))?;
            let chain = format!("{cert}{roots}");
            write_files(
                out,
                &[
                    (CA_CERT_FILE, Content::Public(&cert)),
                    (CA_KEY_FILE, Content::Secret(&key)),
                    (CERT_CHAIN_FILE, Content::Public(&chain)),
                    (ROOT_CERT_FILE, Content::Public(&roots)),
                ],
                *force,
            )?;
            // The same check the agent makes at --ca-dir (the trust domain only names
            // the probe leaf).
            let set = ca_dir::load_ca_dir(out, "cluster.local", now).map_err(|e| {
                anyhow::anyhow!("the written set does not pass --ca-dir's check: {e}")
            })?;
            println!("{} written to {}", set.describe(), out.display());
        }
    }
    Ok(())
}

enum Content<'a> {
    Public(&'a str),
    Secret(&'a SecretPem),
}

impl Content<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Content::Public(s) => s.as_bytes(),
            Content::Secret(s) => s.expose().as_bytes(),
        }
    }
}

/// The output directory: created 0700, or an existing real directory of ours that
/// only we can enter.
fn prepare_dir(dir: &Path) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display())),
        Err(e) => Err(e).with_context(|| format!("{}", dir.display())),
        Ok(meta) if meta.file_type().is_symlink() => {
            bail!(
                "{} is a symlink: refusing to write keys through it",
                dir.display()
            )
        }
        Ok(meta) if !meta.is_dir() => bail!("{} is not a directory", dir.display()),
        Ok(meta) => {
            let euid = nix::unistd::geteuid().as_raw();
            if meta.uid() != euid {
                bail!(
                    "{} belongs to uid {}, not to us ({euid}): refusing to write keys there",
                    dir.display(),
                    meta.uid()
                );
            }
            if meta.mode() & 0o077 != 0 {
                bail!(
                    "{} is accessible to group or others (mode {:o}): `chmod 700` it first",
                    dir.display(),
                    meta.mode() & 0o7777
                );
            }
            Ok(())
        }
    }
}

/// Writes each file 0600. Without `force`, every target must be absent (checked for all
/// before any is written, and each file is created with O_EXCL, which also refuses a
/// symlink at its path). With `force`, each is written to a fresh temporary name and
/// renamed over the old one (a rename replaces a symlink; it never writes through it).
fn write_files(dir: &Path, files: &[(&str, Content<'_>)], force: bool) -> anyhow::Result<()> {
    prepare_dir(dir)?;
    if !force {
        for (name, _) in files {
            let path = dir.join(name);
            if std::fs::symlink_metadata(&path).is_ok() {
                bail!(
                    "{} exists: not overwriting it (pass --force to replace the set)",
                    path.display()
                );
            }
        }
    }
    for (name, content) in files {
        let path = dir.join(name);
        let target = if force {
            dir.join(format!(".{name}.tmp-{}", std::process::id()))
        } else {
            path.clone()
        };
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&target)
            .with_context(|| format!("creating {}", target.display()))?;
        file.write_all(content.bytes())
            .and_then(|()| file.sync_all())
            .with_context(|| format!("writing {}", target.display()))?;
        if force {
            std::fs::rename(&target, &path)
                .with_context(|| format!("renaming {} to {}", target.display(), path.display()))?;
        }
    }
    Ok(())
}
