//! Whether a process's cgroup is frozen: by cgroup v2's `cgroup.freeze`
//! (its tasks sleep in the signal path and run no user code until thawed)
//! or by the v1 freezer.

use std::fs;

use super::process_dir;

/// The cgroup `pid` is frozen in, by either freezer, if it is: its path in
/// that hierarchy.
pub fn frozen_cgroup(pid: u32) -> Option<String> {
    let memberships = fs::read_to_string(process_dir(pid).join("cgroup")).ok()?;
    let mounts = fs::read_to_string(process_dir(std::process::id()).join("mountinfo")).ok()?;
    memberships.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let (mount, file, frozen): (_, _, fn(&str) -> bool) = if controllers.is_empty() {
            (
                mount_point(&mounts, "cgroup2", None)?,
                "cgroup.events",
                |events| events.lines().any(|l| l.trim() == "frozen 1"),
            )
        } else if controllers.split(',').any(|c| c == "freezer") {
            (
                mount_point(&mounts, "cgroup", Some("freezer"))?,
                "freezer.state",
                |state| matches!(state.trim(), "FROZEN" | "FREEZING"),
            )
        } else {
            return None;
        };
        let state = fs::read_to_string(format!("{mount}{path}/{file}")).ok()?;
        frozen(&state).then(|| path.to_string())
    })
}

/// Where ebtrace sees the hierarchy of file system type `fs_type` (and
/// with `option` among its super options: a v1 controller) mounted whole.
fn mount_point(mountinfo: &str, fs_type: &str, option: Option<&str>) -> Option<String> {
    mountinfo.lines().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        let mut mount = mount.split_whitespace();
        let root = mount.nth(3)?;
        let point = mount.next()?;
        let mut fs = fs.split_whitespace();
        let (ty, _, options) = (fs.next()?, fs.next()?, fs.next().unwrap_or(""));
        let has_option = option.is_none_or(|o| options.split(',').any(|x| x == o));
        (ty == fs_type && root == "/" && has_option).then(|| point.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::mount_point;

    #[test]
    fn the_hierarchies_are_found_where_they_are_mounted() {
        let mountinfo = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
50 41 0:38 /pod /mnt/pod rw,relatime - cgroup2 cgroup2 rw
";
        assert_eq!(
            mount_point(mountinfo, "cgroup2", None).as_deref(),
            Some("/sys/fs/cgroup/unified")
        );
        assert_eq!(
            mount_point(mountinfo, "cgroup", Some("freezer")).as_deref(),
            Some("/sys/fs/cgroup/freezer")
        );
        assert_eq!(mount_point(mountinfo, "cgroup", Some("memory")), None);
    }
}
