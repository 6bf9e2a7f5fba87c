//! The user database (the C library's, so NSS sources count): the groups
//! a user belongs to, and group ids by name, for `serve`'s policy.

use std::ffi::{CStr, CString};

/// Bytes for the C library's answer about one user or group.
const LOOKUP_BUFFER: usize = 64 * 1024;
/// The most groups one user is looked up in.
const MAX_GROUPS: usize = 1024;

/// The id of the group `name`, if there is one.
pub fn group_id(name: &str) -> Option<u32> {
    let name = CString::new(name).ok()?;
    // SAFETY: all zero is a valid `group`.
    let mut group: libc::group = unsafe { std::mem::zeroed() };
    let mut buffer = vec![0 as libc::c_char; LOOKUP_BUFFER];
    let mut found = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the length given, and `found`
    // points into `group` only while `buffer` lives.
    let rc = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &mut group,
            buffer.as_mut_ptr(),
            buffer.len(),
            &mut found,
        )
    };
    (rc == 0 && !found.is_null()).then_some(group.gr_gid)
}

/// The groups of user `uid`: its primary group and every group that lists
/// it; none for a uid the database does not know.
pub fn groups_of(uid: u32) -> Vec<u32> {
    // SAFETY: all zero is a valid `passwd`.
    let mut user: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buffer = vec![0 as libc::c_char; LOOKUP_BUFFER];
    let mut found = std::ptr::null_mut();
    // SAFETY: as in `group_id`.
    let rc = unsafe {
        libc::getpwuid_r(
            uid,
            &mut user,
            buffer.as_mut_ptr(),
            buffer.len(),
            &mut found,
        )
    };
    if rc != 0 || found.is_null() {
        return Vec::new();
    }
    // SAFETY: `pw_name` is a C string in `buffer`, which lives.
    let name = unsafe { CStr::from_ptr(user.pw_name) };
    let mut groups = vec![0 as libc::gid_t; MAX_GROUPS];
    let mut count = MAX_GROUPS as libc::c_int;
    // SAFETY: `groups` holds `count` entries.
    let rc =
        unsafe { libc::getgrouplist(name.as_ptr(), user.pw_gid, groups.as_mut_ptr(), &mut count) };
    if rc < 0 {
        // More than MAX_GROUPS: those that fit are still its groups.
        count = MAX_GROUPS as libc::c_int;
    }
    groups.truncate(count.max(0) as usize);
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_in_its_own_group() {
        assert_eq!(group_id("root"), Some(0));
        assert!(groups_of(0).contains(&0));
        assert_eq!(group_id("no such group, surely"), None);
        assert!(groups_of(4_000_000_000).is_empty());
    }
}
