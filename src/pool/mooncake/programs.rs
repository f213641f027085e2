//! The helper's interpreter and script, resolved to absolute paths once at start-up and
//! checked before the daemon ever executes them.
//!
//! The helper runs as the daemon's user with the host arena mapped, so whoever can replace
//! the interpreter or the script owns every page. A path is accepted only when nobody but
//! the daemon's user or root could have put it there or can swap it: the file (and, for a
//! symlink such as a venv's `bin/python3`, what it points at) is owned by the daemon's uid
//! or root and not writable by group or others, and so is every directory above both,
//! except that a sticky directory (`/tmp`) may be writable (its entries can be renamed
//! only by their owners).
//!
//! Where a path comes from:
//! - an absolute path is used as given;
//! - a bare command name (`python3`) is looked up in the absolute entries of `PATH`, at
//!   start-up, and the result used from then on;
//! - any other relative path is refused: it would be resolved against the daemon's working
//!   directory, which may be a directory another user can write.

use std::ffi::OsStr;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use crate::tier::private::euid;

/// Why the helper's interpreter or script was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProgramError {
    #[error(
        "{what} {path:?} is a relative path; give an absolute path or a bare command name looked up in PATH \
         (a relative path is never resolved against the daemon's working directory)"
    )]
    Relative { what: &'static str, path: PathBuf },
    #[error("{what} {name:?} is not an executable file in any absolute directory of PATH")]
    NotFound { what: &'static str, name: String },
    #[error("{what} {path}: {error}")]
    Io {
        what: &'static str,
        path: PathBuf,
        error: String,
    },
    #[error(
        "{what}: {path} is owned by uid {owner} with mode {mode:o}; the daemon (uid {uid}) executes only \
         files and directories owned by itself or root that no one else can write"
    )]
    Untrusted {
        what: &'static str,
        path: PathBuf,
        owner: u32,
        mode: u32,
        uid: u32,
    },
    #[error("{what}: {path} is not a regular file")]
    NotAFile { what: &'static str, path: PathBuf },
}

/// Resolves `given` as the module doc says and checks it; returns the absolute path to
/// execute. `what` names the setting in errors (`mooncake.python`).
pub fn resolve(given: &Path, what: &'static str, path_var: Option<&OsStr>) -> Result<PathBuf, ProgramError> {
    let path = if given.is_absolute() {
        given.to_owned()
    } else if is_bare_name(given) {
        search_path(given, what, path_var)?
    } else {
        return Err(ProgramError::Relative {
            what,
            path: given.to_owned(),
        });
    };
    check(&path, what)?;
    Ok(path)
}

/// Checks an absolute path the daemon will execute or hand to its interpreter: see the
/// module doc. The path is resolved as the kernel resolves it, name by name and link by
/// link ([`walk`]), and every directory that holds a name on the way (a link's included,
/// wherever in a chain of links it sits) must be trusted; then the file it ends at.
pub fn check(path: &Path, what: &'static str) -> Result<(), ProgramError> {
    let real = walk(path, what)?;
    let md = std::fs::metadata(&real).map_err(|e| io_error(what, &real, e))?;
    if !md.is_file() {
        return Err(ProgramError::NotAFile { what, path: real });
    }
    trusted(&real, &md, what, false)
}

fn io_error(what: &'static str, p: &Path, e: std::io::Error) -> ProgramError {
    ProgramError::Io {
        what,
        path: p.to_owned(),
        error: e.to_string(),
    }
}

/// Most links followed resolving one path (the kernel's own limit).
const MAX_LINKS: usize = 40;

/// Resolves absolute `path` one name at a time, following links, and checks the directory
/// each name is looked up in ([`trusted`]); in a sticky directory the entry itself must be
/// the daemon's uid's or root's too, since its owner may replace it. Returns the path it
/// ends at, with no link left in it.
fn walk(path: &Path, what: &'static str) -> Result<PathBuf, ProgramError> {
    let io = |p: &Path, e: std::io::Error| io_error(what, p, e);
    // Names still to resolve, the next last.
    let mut todo: Vec<std::ffi::OsString> = Vec::new();
    let push = |todo: &mut Vec<std::ffi::OsString>, p: &Path| {
        let names: Vec<_> = p
            .components()
            .filter_map(|c| match c {
                Component::Normal(n) => Some(n.to_owned()),
                Component::ParentDir => Some("..".into()),
                _ => None,
            })
            .collect();
        todo.extend(names.into_iter().rev());
    };
    push(&mut todo, path);
    let mut at = PathBuf::from("/");
    let mut links = 0;
    while let Some(name) = todo.pop() {
        if name == ".." {
            at.pop();
            continue;
        }
        let dir = std::fs::metadata(&at).map_err(|e| io(&at, e))?;
        trusted(&at, &dir, what, true)?;
        let next = at.join(&name);
        let md = std::fs::symlink_metadata(&next).map_err(|e| io(&next, e))?;
        if dir.mode() & libc::S_ISVTX != 0 && md.uid() != euid() && md.uid() != 0 {
            return Err(ProgramError::Untrusted {
                what,
                path: next,
                owner: md.uid(),
                mode: md.mode() & 0o7777,
                uid: euid(),
            });
        }
        if !md.file_type().is_symlink() {
            at = next;
            continue;
        }
        links += 1;
        if links > MAX_LINKS {
            return Err(io(path, std::io::Error::from_raw_os_error(libc::ELOOP)));
        }
        let target = std::fs::read_link(&next).map_err(|e| io(&next, e))?;
        if target.is_absolute() {
            at = PathBuf::from("/");
        }
        push(&mut todo, &target);
    }
    Ok(at)
}

fn trusted(path: &Path, md: &std::fs::Metadata, what: &'static str, dir: bool) -> Result<(), ProgramError> {
    let uid = euid();
    let sticky = dir && md.mode() & libc::S_ISVTX != 0;
    if (md.uid() != uid && md.uid() != 0) || (md.mode() & 0o022 != 0 && !sticky) {
        return Err(ProgramError::Untrusted {
            what,
            path: path.to_owned(),
            owner: md.uid(),
            mode: md.mode() & 0o7777,
            uid,
        });
    }
    Ok(())
}

fn is_bare_name(p: &Path) -> bool {
    let mut parts = p.components();
    matches!((parts.next(), parts.next()), (Some(Component::Normal(_)), None))
}

fn search_path(name: &Path, what: &'static str, path_var: Option<&OsStr>) -> Result<PathBuf, ProgramError> {
    let not_found = || ProgramError::NotFound {
        what,
        name: name.display().to_string(),
    };
    let var = path_var.ok_or_else(not_found)?;
    std::env::split_paths(var)
        .filter(|d| d.is_absolute())
        .map(|d| d.join(name))
        .find(|p| std::fs::metadata(p).is_ok_and(|md| md.is_file() && md.mode() & 0o111 != 0))
        .ok_or_else(not_found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn relative_paths_are_refused_and_bare_names_come_from_absolute_path_entries() {
        let e = resolve(Path::new(".venv/bin/python3"), "mooncake.python", None).unwrap_err();
        assert!(matches!(e, ProgramError::Relative { .. }), "{e}");
        assert!(e.to_string().contains("working directory"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        chmod(dir.path(), 0o755);
        let bin = dir.path().join("py");
        std::fs::write(&bin, b"#!/bin/sh\n").unwrap();
        chmod(&bin, 0o755);
        // A relative PATH entry is skipped even when it holds the name.
        let var = std::ffi::OsString::from(format!(".:{}", dir.path().display()));
        assert_eq!(resolve(Path::new("py"), "x", Some(&var)).unwrap(), bin);
        let e = resolve(Path::new("py"), "x", Some(OsStr::new("."))).unwrap_err();
        assert!(matches!(e, ProgramError::NotFound { .. }), "{e}");
    }

    #[test]
    fn writable_files_and_directories_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        chmod(dir.path(), 0o755);
        let bin = dir.path().join("py");
        std::fs::write(&bin, b"#!/bin/sh\n").unwrap();
        chmod(&bin, 0o755);
        assert_eq!(check(&bin, "x"), Ok(()));
        chmod(&bin, 0o757);
        assert!(matches!(check(&bin, "x"), Err(ProgramError::Untrusted { .. })));
        chmod(&bin, 0o755);
        chmod(dir.path(), 0o777);
        let e = check(&bin, "x").unwrap_err();
        assert!(
            matches!(&e, ProgramError::Untrusted { path, .. } if path == &std::fs::canonicalize(dir.path()).unwrap()),
            "{e}"
        );
        // A symlink in a private directory to a file in a writable one: refused too.
        chmod(dir.path(), 0o755);
        let loose = dir.path().join("loose");
        std::fs::create_dir(&loose).unwrap();
        chmod(&loose, 0o777);
        let target = loose.join("real");
        std::fs::write(&target, b"#!/bin/sh\n").unwrap();
        chmod(&target, 0o755);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(matches!(check(&link, "x"), Err(ProgramError::Untrusted { .. })));
        assert!(matches!(check(dir.path(), "x"), Err(ProgramError::NotAFile { .. })));
    }

    #[test]
    fn a_link_in_the_middle_of_a_chain_is_checked_where_it_lies() {
        let dir = tempfile::tempdir().unwrap();
        chmod(dir.path(), 0o755);
        let real = dir.path().join("real");
        std::fs::write(&real, b"#!/bin/sh\n").unwrap();
        chmod(&real, 0o755);
        // bin/python3 -> loose/mid -> real: the first link and the file are in trusted
        // directories, the middle link in one anybody can write (and swap it in).
        let (bin, loose) = (dir.path().join("bin"), dir.path().join("loose"));
        std::fs::create_dir(&bin).unwrap();
        std::fs::create_dir(&loose).unwrap();
        chmod(&bin, 0o755);
        chmod(&loose, 0o777);
        std::os::unix::fs::symlink(&real, loose.join("mid")).unwrap();
        std::os::unix::fs::symlink("../loose/mid", bin.join("python3")).unwrap();
        let e = check(&bin.join("python3"), "x").unwrap_err();
        assert!(
            matches!(&e, ProgramError::Untrusted { path, .. } if path.ends_with("loose")),
            "{e}"
        );
        // With that directory locked down, the same chain passes, and a directory link
        // on the way is resolved too.
        chmod(&loose, 0o755);
        assert_eq!(check(&bin.join("python3"), "x"), Ok(()));
        std::os::unix::fs::symlink(&bin, dir.path().join("venv")).unwrap();
        assert_eq!(check(&dir.path().join("venv/python3"), "x"), Ok(()));
        // A loop is an error, not a hang.
        std::os::unix::fs::symlink("b", loose.join("a")).unwrap();
        std::os::unix::fs::symlink("a", loose.join("b")).unwrap();
        assert!(matches!(check(&loose.join("a"), "x"), Err(ProgramError::Io { .. })));
    }
}
