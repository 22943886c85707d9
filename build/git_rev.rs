//! Build script shared by the four binaries (`build = "../build/git_rev.rs"`): records the git
//! revision the binary was built from as `FELIX_GIT_REV`, for `--version`. Outside a git
//! checkout (a source tarball, a .deb built from one) it says `unknown`.

use std::process::Command;

fn main() {
    let rev = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=FELIX_GIT_REV={rev}");
    // A new commit changes HEAD (or the branch it points to); rebuild the version then.
    for p in ["../.git/HEAD", "../.git/refs/heads"] {
        if std::path::Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
}
